"""The offline throughput workload (inflight/bench/offline.py): its untimed warm-up pass has the
timed pass's shape and shares no cached prefix with it."""

from inflight.bench.offline import load_tokenizer, make_workload


def test_the_warm_up_pass_has_the_workloads_shape_and_none_of_its_prefixes(tiny_dirs):
    work = make_workload(load_tokenizer(tiny_dirs["llama"]), 16, 38, 64)
    assert len(work.warmup) == len(work.prompts) == 16
    assert all(len(p) == 38 for p in work.warmup + work.prompts)
    # The first KV block (16 tokens) of a warm-up prompt is no timed prompt's.
    starts = {tuple(p[:16]) for p in work.prompts}
    assert not starts & {tuple(p[:16]) for p in work.warmup}


def test_every_round_has_prompts_of_its_own(tiny_dirs):
    """Rounds after the first draw prompts of their own: no timed round's first KV block is
    another's or the warm-up's, so a cache cannot carry one round's prefill into the next."""
    work = make_workload(load_tokenizer(tiny_dirs["llama"]), 16, 38, 64, rounds=3)
    assert len(work.rounds) == 3 and work.prompts == work.rounds[0]
    assert all(len(r) == 16 and all(len(p) == 38 for p in r) for r in work.rounds)
    firsts = [{tuple(p[:16]) for p in prompts} for prompts in [*work.rounds, work.warmup]]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1 :]:
            assert not a & b
