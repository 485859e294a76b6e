"""Held-out evaluation, confidence calibration and the model card of a block drafter.

Offline metrics on the target's greedy continuations of held-out text, every
block fully labelled (teacher-forced context = what the engine sees when the
prefix was accepted): per-position conditional acceptance, top-1 and top-16
coverage given an accepted prefix, simulated acceptance length with all
block - 1 drafts verified, and for DSpark the confidence head's ECE.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.drafters.calibration import ece
from configs.jsonio import write_json
from actors.drafters.decode import draft_block


@torch.no_grad()
def _drafts(model, data: dict, stride: int = 4, chunk: int = 16, use_selector=None):
    bs = model.config.block_size
    toks = data["tokens"].long()
    S, P = toks.shape[1], data["prompt_len"]
    anchors = torch.arange(P - 1, S - bs + 1, stride)
    nb = len(anchors)
    outs = []
    for i in range(0, len(toks), chunk):
        t = toks[i:i + chunk]
        b = len(t)
        aux = data["feats"][i:i + chunk].float()
        C = aux.shape[1]
        kv = model.context_kv(aux, torch.arange(C).expand(b, C))
        a = anchors.expand(b, nb)
        mask = torch.arange(C)[None, None, :] < a[..., None]
        h = model.block_hidden(t.gather(1, a), a, kv, mask).view(b * nb, bs, -1)
        d = draft_block(model, h, t.gather(1, a).reshape(-1), 16, use_selector)
        labels = t.gather(1, (a[..., None] + torch.arange(1, bs)).view(b, -1)).view(b * nb, -1)
        outs.append((d, labels))
    cat = lambda f: torch.cat([f(d, l) for d, l in outs])  # noqa: E731
    conf = cat(lambda d, l: d.confidence) if outs[0][0].confidence is not None else None
    return (cat(lambda d, l: d.tokens), cat(lambda d, l: d.top1), cat(lambda d, l: d.topk_ids),
            conf, cat(lambda d, l: l))




def _block_metrics(tokens, top1, topk, labels) -> dict:
    hit = tokens == labels
    prefix_ok = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1].bool()], 1)
    n_ok = prefix_ok.sum(0).clamp(min=1).float()
    r = lambda x: [round(v, 4) for v in x.tolist()]  # noqa: E731
    return {"blocks": len(labels),
            "tau_sim": round(1 + hit.cumprod(1).sum(1).float().mean().item(), 4),
            "accept_cond": r((hit & prefix_ok).sum(0) / n_ok),
            "top1_cond": r(((top1 == labels) & prefix_ok).sum(0) / n_ok),
            "top16_cond": r(((topk == labels[..., None]).any(-1) & prefix_ok).sum(0) / n_ok)}


def evaluate_split(model, data: dict) -> dict:
    """Held-out metrics of the drafter's own decoding (and of the selector variant)."""
    default_sel = model.selector is not None and model.config.method == "dflash2"
    tokens, top1, topk, conf, labels = _drafts(model, data, use_selector=default_sel)
    out = _block_metrics(tokens, top1, topk, labels)
    if model.selector is not None:
        alt = _drafts(model, data, use_selector=not default_sel)
        out["without_selector" if default_sel else "with_selector"] = {
            k: v for k, v in _block_metrics(*alt[:3], alt[4]).items() if k != "blocks"}
    if conf is not None:
        hit = tokens == labels
        ok = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1].bool()], 1)
        p, y = conf[ok].numpy(), hit[ok].float().numpy()
        out["confidence"] = {"ece": round(ece(p, y), 4), "brier": round(float(((p - y) ** 2).mean()), 4),
                             "mean_pred": round(float(p.mean()), 4),
                             "mean_accept": round(float(y.mean()), 4)}
    return out


def fit_platt(model, data: dict) -> dict:
    """Fit sigmoid(a z + b) of the confidence logit z on ``data`` (prefix-accepted
    positions); returns a, b and the split's ECE before and after."""
    model.config = replace(model.config, calib_a=1.0, calib_b=0.0)
    tokens, _, _, conf, labels = _drafts(model, data)
    hit = tokens == labels
    ok = torch.cat([torch.ones_like(hit[:, :1]), hit.cumprod(1)[:, :-1].bool()], 1)
    z = torch.logit(conf[ok].double().clamp(1e-6, 1 - 1e-6))
    y = hit[ok].double()
    ab = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    a, b = (float(v) for v in ab.detach())
    cal = torch.sigmoid(a * z + b).numpy()
    return {"a": round(a, 5), "b": round(b, 5), "split": "calib (train-corpus windows, unseen)",
            "positions": int(len(y)), "ece_before": round(ece(torch.sigmoid(z).numpy(), y.numpy()), 4),
            "ece_after": round(ece(cal, y.numpy()), 4)}


def write_card(out: Path, card: dict) -> None:
    write_json(out / "training.json", card)
    cfg, a = card["config"], card["args"]
    cmd = (f"python -m train.drafters --method {a['method']} --seed {a['seed']} --layers {a['layers']}"
           f" --minutes {a['minutes']} --threads {a['threads']} --train-seqs {a['train_seqs']}"
           + (" --no-selector" if a["no_selector"] else "")
           + (" --joint-selector" if a.get("joint_selector") else "")
           + (" --vllm-heads" if a.get("vllm_heads") else "")
           + (f" --init {a['init']}" if a.get("init") not in (None, "None") else "")
           + (f" --lr {a['lr']}" if a.get("lr") not in (None, 2e-3) else "")
           + (f" --out {a['out']}" if a["out"] not in (None, "None") else ""))
    pc = card["params_by_component"]
    lines = [f"# {out.name}: {cfg['method']} block drafter for models/target", "",
             "Parallel drafter (DFlash arXiv 2602.06036; DFlash 2 \"Keep Drafting Parallel\"; "
             "DSpark arXiv 2607.05147) trained by `train/drafters.py` on the target's greedy "
             "continuations of real text (CPython source + Python docs).", "",
             f"- command: `{cmd}` (nice -n 5, shared 2-core CPU)",
             f"- seed: {card['seed']}; threads: {card['threads']}; steps: {card['steps']}; "
             f"blocks seen: {card['blocks_seen']}",
             f"- wall time: training {card['train_wall_s']} s (+ feature extraction "
             f"{card['feature_wall_s']} s, cached and shared between drafters)",
             f"- parameters: {card['params']:,} ({100 * card['params'] / card['target_params']:.1f}% "
             f"of the target's {card['target_params']:,}); embedding and LM head are the "
             "target's (shared, not stored)",
             f"- components: conv {pc['conv']:,} ({100 * pc['conv'] / card['params']:.2f}%), "
             f"selector {pc['selector']:,}, markov {pc['markov']:,}, confidence {pc['confidence']:,}",
             f"- layers {cfg['num_layers']}, hidden {cfg['hidden_size']}, block size "
             f"{cfg['block_size']}, target layers {cfg['target_layer_ids']}",
             f"- weights: model.safetensors (bf16) {card['weights_bytes'] / 1e6:.2f} MB", ""]
    if cfg["method"] == "dflash" and cfg["use_selector"]:
        lines += ["The `dflash` strategy drafts by independent top-1 and ignores the path "
                  "selector stored here; the selector was trained on detached backbone features "
                  "(the backbone is pure DFlash) and serves the `dflash2_selector_only` ablation "
                  "of `bench.acceptance`.", ""]
    if cfg["method"] == "dflash" and cfg["num_layers"] > 1:
        lines += [f"A {cfg['num_layers']}-layer DFlash for the depth ablation (`dflash_deep` in "
                  "`bench.acceptance`, the scaled-down \"5 vs 15 layers\" comparison).", ""]
    if card.get("calibration"):
        c = card["calibration"]
        lines += [f"- confidence calibration (Platt) on {c['positions']} positions of {c['split']}: "
                  f"a={c['a']}, b={c['b']}, ECE {c['ece_before']} -> {c['ece_after']}", ""]
    lines += ["## Held-out metrics (greedy continuations of held-out text; conditional = given "
              "an accepted prefix)", "",
              "| domain | tau (all 7 verified) | accept_cond per pos | top1_cond | top16_cond |",
              "|---|---|---|---|---|"]
    for d, m in card["heldout"].items():
        lines.append(f"| {d} | {m['tau_sim']} | {m['accept_cond']} | {m['top1_cond']} | "
                     f"{m['top16_cond']} |")
        for k in ("with_selector", "without_selector"):
            if k in m:
                lines.append(f"| {d} ({k.replace('_', ' ')}) | {m[k]['tau_sim']} | "
                             f"{m[k]['accept_cond']} | | |")
        if "confidence" in m:
            lines.append(f"| {d} confidence | ECE {m['confidence']['ece']}, Brier "
                         f"{m['confidence']['brier']} | mean pred {m['confidence']['mean_pred']} "
                         f"vs accepted {m['confidence']['mean_accept']} | | |")
    lines += ["", "Engine-measured figures (acceptance length, speedups) come from "
              "`python -m bench.acceptance`.", ""]
    (out / "README.md").write_text("\n".join(lines))
