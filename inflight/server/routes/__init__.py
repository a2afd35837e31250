"""The server's routes, one router per API: OpenAI, Anthropic, and operations."""

# The methods of a route that reads: HEAD wherever GET, as HTTP asks of a server (aiperf probes
# /metrics so); uvicorn sends a HEAD reply's headers without its body.
READ = ["GET", "HEAD"]
