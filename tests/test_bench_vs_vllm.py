"""bench.vs_vllm and its worker: what they count (no speed thresholds here)."""

from __future__ import annotations

import pytest

from bench import closed_loop_worker as bcl
from bench import vs_vllm as bvv


def test_prompts_are_the_load_generators_mixed_corpus():
    from loadgen.run.datasets import load_dataset

    assert bvv.load_prompts() == [p.text for p in load_dataset("mixed", bvv.MAX_PROMPT_CHARS)]


class FakeEngine:
    """Every step emits one token per running request; a request ends after ``n`` tokens."""

    def __init__(self, n: int = 4, step_s: float = 0.002):
        self.n, self.step_s, self.live, self.added, self.aborted = n, step_s, {}, [], []

    def add(self, rid, prompt, max_tokens):
        self.added.append((rid, prompt, max_tokens))
        self.live[rid] = 0

    def step(self):
        import time

        time.sleep(self.step_s)
        out = []
        for rid in list(self.live):
            self.live[rid] += 1
            fin = self.live[rid] >= self.n
            if fin:
                del self.live[rid]
            out.append((rid, 1, fin))
        return out

    def abort(self, rid):
        self.aborted.append(rid)
        self.live.pop(rid, None)


def test_closed_loop_keeps_n_users_and_replaces_each_finished_request():
    eng = FakeEngine()
    res = bcl.closed_loop(eng, ["a", "b", "c"], users=3, duration_s=0.3, max_tokens=4,
                          tag="t", warmup_s=0.05)
    assert res["users"] == 3 and res["requests"] > 0
    # every request the loop added went in with the next prompt, round robin
    assert [p for _, p, _ in eng.added] == [["a", "b", "c"][i % 3] for i in range(len(eng.added))]
    assert all(m == 4 for *_, m in eng.added)
    # at the end every unfinished request is aborted, none is left behind
    assert not eng.live and len(eng.aborted) <= 3
    # 1 token per step per user: tokens/s is about users / step time, TPOT about one step
    assert res["tokens_per_s"] > 0 and res["tpot_ms_p50"] >= 2.0
    assert res["ttft_ms_p50"] >= 2.0


def test_summarize_takes_medians_and_per_repetition_ratios():
    def r(t, ttft, tpot):
        return {"tokens_per_s": t, "ttft_ms_p50": ttft, "tpot_ms_p50": tpot}

    runs = {(4, "specload"): [r(100, 10, 2), r(300, 30, 4), r(200, 20, 3)],
            (4, "vllm"): [r(100, 20, 2), r(100, 10, 2), r(400, 40, 6)]}
    out = bvv.summarize(runs, [4])["4"]
    assert out["specload"] == {"tokens_per_s": 200, "ttft_ms_p50": 20, "tpot_ms_p50": 3}
    # ratios of the same repetition: 1.0, 3.0, 0.5 -> median 1.0 (not 200 / 100)
    assert out["vs_vllm"]["tokens_per_s"] == 1.0
    assert out["vs_vllm"]["ttft_ms_p50"] == 0.5
    assert "vs_baseline" not in out


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--strategies", "dflash"],
                                  ["--concurrency", "a,b"], ["--reps", "0"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bvv.main(argv)
    assert e.value.code == 2
