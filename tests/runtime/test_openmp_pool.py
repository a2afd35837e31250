"""The building thread's OpenMP workers are released once a runtime is built
(openmp_pool.py): the steps' thread then keeps the only pool."""

import subprocess
import sys

# In a fresh process of two threads: a parallel torch op leaves the main thread a worker; the
# release ends it, and a later parallel op starts one again.
SCRIPT = """
import os, time, torch
from inflight.runtime.device.openmp_pool import release_thread_pool
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled(want):
    for _ in range(200):
        if threads() == want:
            return want
        time.sleep(0.01)
    return threads()
before = threads()
torch.ones(1 << 22).sum()
with_pool = settled(before + 1)
assert release_thread_pool()
released = settled(before)
torch.ones(1 << 22).sum()
print(before, with_pool, released, settled(before + 1))
"""


def test_releasing_ends_the_threads_workers_and_a_new_region_restarts_them():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    before, with_pool, released, again = map(int, result.stdout.split())
    assert (with_pool, released, again) == (before + 1, before, before + 1)


def test_open_runtime_releases_the_building_threads_pool(tiny_dirs, monkeypatch):
    from inflight.protocol.deployment import DeploymentOptions
    from inflight.runtime import factory

    calls = []
    monkeypatch.setattr(factory, "release_thread_pool", lambda: calls.append("release"))
    runtime = factory.open_runtime(tiny_dirs["llama"], DeploymentOptions(max_model_len=64))
    assert calls == ["release"]
    runtime.close()
