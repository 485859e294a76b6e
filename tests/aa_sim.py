"""A/A races simulated for the racing statistics (analysis.decide.race): used by tests/test_race.py and
the calibration figures of the closing note. Seven cells per race, two deployments, the
first pass with the A/A (A B A), then mirrored rounds of the contenders left."""
import math, sys
import numpy as np
from analysis.decide import race

def simulate(seed, names=("autoregressive", "twin"), mu=None, cells=7, rounds=5, sd=0.10, walk=0.05, conf=0.9):
    rng = np.random.default_rng(seed)
    mu = mu or {n: 0.0 for n in names}
    t, level = 0.0, 0.0
    reps = {("low", f"c{c}"): {n: [] for n in names} for c in range(cells)}
    def run(c, n):
        nonlocal t, level
        level += walk * rng.standard_normal(); t += 10
        g = 100 * math.exp(mu[n] + level + sd * rng.standard_normal())
        reps[("low", f"c{c}")][n].append(race.Replicate(np.full(10, g / 10 * 10.0), 10.0, 10, len(reps[("low", f"c{c}")][n]), t))
    looks = []
    for c in range(cells):           # first pass with the A/A
        for n in names: run(c, n)
        run(c, names[0])
    live = {c: list(names) for c in range(cells)}
    decisions = {}
    for k in range(rounds + 1):
        t += 1; looks.append(t)
        noise = race.run_noise(reps)
        undecided = []
        for c in range(cells):
            d = race.decide_replicates(reps[("low", f"c{c}")], conf, 0.03, looks, noise)
            decisions[c] = d
            if d.status == race.UNDECIDED:
                undecided.append(c)
        if not undecided or k == rounds:
            break
        fwd = (1 + k) % 2 == 0
        for c in undecided:
            order = [n for n in names if n in decisions[c].contenders]
            for n in (order if fwd else order[::-1]):
                run(c, n)
    return decisions

if __name__ == "__main__":
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    tot = dec = eqv = 0
    for s in range(N):
        ds = simulate(s)
        for d in ds.values():
            tot += 1; dec += d.status == race.DECIDED; eqv += d.status == race.EQUIVALENT
    print(f"A/A cells {tot}: decided {dec} ({dec/tot:.1%}), equivalent {eqv} ({eqv/tot:.1%})")
    tot = dec = right = 0
    for s in range(N):
        ds = simulate(1000 + s, mu={"autoregressive": 0.0, "twin": 0.25})
        for d in ds.values():
            tot += 1; dec += d.status == race.DECIDED; right += d.status == race.DECIDED and d.leader == "twin"
    print(f"25% gap cells {tot}: decided {dec} ({dec/tot:.1%}), right {right}")
