"""glibc's malloc keeps what a CPU step frees for the next step (host_allocator.py). Its effect
on short chats is measured in bench/RESULTS.md ("Short chats on an AVX-512 box"); that a CPU
runner sets it before loading its weights, in test_model_runner.py."""

from inflight.runtime.device.host_allocator import keep_freed_memory


def test_glibc_takes_the_thresholds():
    assert keep_freed_memory()
