"""Media encoders (images, audio): each one's config, its Hugging Face parsing and its module,
and the preprocessing that prepares an item for it."""
