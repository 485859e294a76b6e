"""Export a specload block drafter in the layout vLLM 0.32 loads (``DFlashDraftModel``).

    python -m train.export_vllm DRAFTER OUT [--target DIR] [--dtype float32|bfloat16]

DRAFTER is ``dflash``, ``dflash2``, ``dspark`` (``models/<name>``) or a drafter
directory. OUT receives ``config.json`` + ``model.safetensors`` that vLLM's
``vllm/model_executor/models/qwen3_dflash.py`` (``DFlashQwen3ForCausalLM``)
loads as the draft of ``--speculative-config '{"method": "dflash", "model": OUT,
"num_speculative_tokens": block_size - 1}'`` beside the target (``models/target``).

What maps one to one (docs/serving.md "DFlash, DFlash 2 and DSpark on vLLM"):
``fc`` [H, A*H] and ``hidden_norm`` (context fusion, fc then RMSNorm, as vLLM's
``combine_hidden_states`` + ``precompute_and_store_context_kv``); the decoder
layer (q/k/v/o, per-head q/k RMSNorm, neox RoPE, SiLU MLP, pre-norm residuals)
under ``layers.<i>.self_attn.*`` / ``layers.<i>.mlp.*``; ``norm``; the target
layer ids (specload's id i = the output of target layer i = vLLM's
``dflash_config.target_layer_ids`` i, which vLLM captures at ``i + 1``); block size.
The target's LM head is shared (not shipped: vLLM aliases the target's).

What is re-expressed exactly: specload's learned ``mask_embed`` vector is
not a vocabulary row. vLLM embeds masked slots as ``embed_tokens[mask_token_id]``;
reusing a real token id would also give the anchor the mask vector whenever the
anchor is that token. So the export ships its own ``embed_tokens`` of V + 1 rows
(the target's V rows, then ``mask_embed``), ``vocab_size`` V + 1,
``draft_vocab_size`` V and ``mask_token_id`` V: an id the target never emits.

What does not map (``VllmExportError``, exit 2, naming the difference):

- dflash2: specload's DynamicConv2 predicts per-channel taps through a rank-r
  SiLU bottleneck, ``k = W_up silu(W_down x) + b``, applied to the normed input
  of attention and of the MLP only; vLLM's ``DFlashGroupedConv`` has taps
  ``base[tap, ch] + (W x)[tap, group]`` (linear in x, per channel group), applied
  before *and* after each sublayer. A SiLU bottleneck is not a linear map, so no
  choice of vLLM's weights reproduces it. The path selectors differ too:
  specload's pairwise term ``<W_l e_prev, W_r e_c>`` has no hidden-state factor,
  vLLM's ``CandidateSelector`` scores ``sum_r P[prev]_r (W_h h)_r S[c]_r``
  (a bias-free linear map of h cannot be a constant).
- dspark: specload's Markov head corrects the hidden state,
  ``h' = h + U silu(P e_prev + C h + b)``, then the shared LM head; vLLM's
  ``DSparkMarkovHead`` adds a token-only bias ``markov_w2(markov_w1[prev])`` to the
  logits (no h, no SiLU). The confidence heads differ as well: specload's reads
  [h, z, top-1 log-prob, margin, entropy] with Platt calibration, vLLM's
  ``sigmoid(proj([h, markov_embed]))``.

DSpark in vLLM's head forms (``python -m train.drafters --method dspark --vllm-heads``,
``models/dspark_vllm``: ``markov_hidden_term`` and ``confidence_logit_features`` off) is
exported exactly as vLLM's ``Qwen3DSparkModel`` (``qwen3_dspark.py``): with C = 0 the
logit update ``silu(P e_prev + b) (W_lm U)^T`` is vLLM's token-only bias, so
``markov_w1`` = silu(P E^T + b) [V + 1, r] (E the target's embedding, the mask row last)
and ``markov_w2`` = W_lm U [V, r]; the Platt calibration sigmoid(a z + b) folds into the
confidence head, ``proj`` = a [w_h, w_z], bias a b0 + b (vLLM: ``sigmoid(proj([h,
markov_embed]))``, ``confidence_head_with_markov``). specload's block is DFlash's 1 + N
fill-in layout (the anchor, then the masks, each predicting its own position), vLLM's
``sample_from_anchor: false``.

``--backbone-only`` exports a dflash2 / dspark drafter's backbone as a plain
vLLM DFlash drafter (convs, selector and heads dropped): a different drafter
than the one trained, for a look at vLLM's path on those weights only; the
export writes ``specload_export.json`` saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import torch

from configs.paths import MODELS_DIR

# specload's weight name (inside ``layers.<i>.``) -> vLLM DFlash checkpoint name
_LAYER_NAMES = {
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight",
    "k_norm.weight": "self_attn.k_norm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight",
              "norm.weight": "norm.weight"}
# heads specload's dflash strategy never runs (``BlockDraftProposer.use_selector = False``)
_UNUSED_BY_DFLASH = ("selector.",)

CONV_DIFFERENCE = (
    "specload's DFlash 2 conv predicts per-channel taps through a rank-{r} SiLU bottleneck "
    "(k = W_up silu(W_down x) + b) on the normed input of attention and MLP only; vLLM's "
    "DFlashGroupedConv uses taps base + (W x) per channel group, linear in x, before and after "
    "each sublayer: no vLLM weights reproduce a SiLU bottleneck")
SELECTOR_DIFFERENCE = (
    "specload's path selector scores a*logp(c) + <Wq h, Wc e_c> + <Wl e_prev, Wr e_c>; vLLM's "
    "CandidateSelector scores logits(c) + sum_r P[prev]_r (W h)_r S[c]_r: the pairwise term "
    "without a hidden-state factor has no vLLM equivalent")
MARKOV_DIFFERENCE = (
    "specload's Markov head corrects the hidden state, h' = h + U silu(P e_prev + C h + b), "
    "before the LM head; vLLM's DSparkMarkovHead adds a token-only logit bias "
    "markov_w2(markov_w1[prev]) (no h, no SiLU)")
CONFIDENCE_DIFFERENCE = (
    "specload's confidence head reads [h, z, top-1 log-prob, margin, entropy] with Platt "
    "calibration; vLLM's is sigmoid(proj([h, markov_embed]))")


class VllmExportError(ValueError):
    """The drafter has a part vLLM 0.32's Qwen3 DFlash / DFlash 2 / DSpark cannot express."""


def differences(cfg) -> list[str]:
    """The parts of drafter config ``cfg`` (``DrafterConfig``) that vLLM cannot load
    faithfully, as sentences; [] when the export is exact. The selector only counts for
    dflash2 (specload's dflash strategy never runs it); the DSpark heads only in
    specload's own forms (``markov_hidden_term`` / ``confidence_logit_features``)."""
    out = []
    if cfg.use_conv:
        out.append(CONV_DIFFERENCE.format(r=cfg.conv_rank))
    if cfg.use_selector and cfg.method != "dflash":
        out.append(SELECTOR_DIFFERENCE)
    if cfg.use_markov and cfg.markov_hidden_term:
        out.append(MARKOV_DIFFERENCE)
    if cfg.use_confidence and (cfg.confidence_logit_features or not cfg.use_markov):
        out.append(CONFIDENCE_DIFFERENCE)
    return out


def vllm_method(cfg) -> str:
    """vLLM's ``speculative_config.method`` for drafter config ``cfg``: ``dspark`` for a
    drafter with a Markov head, else ``dflash``."""
    return "dspark" if cfg.use_markov else "dflash"


def vllm_config(cfg, target_cfg: dict, dtype: str) -> dict:
    """The draft ``config.json`` vLLM 0.32 reads for ``DFlashDraftModel``.

    cfg: the drafter's ``DrafterConfig``; target_cfg: the target's config.json as a dict.
    """
    V = cfg.vocab_size
    dspark = {}
    if vllm_method(cfg) == "dspark":
        dspark = {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
                  "enable_confidence_head": bool(cfg.use_confidence),
                  "confidence_head_with_markov": bool(cfg.use_confidence),
                  "sample_from_anchor": False}
    return {
        "architectures": ["Qwen3DSparkModel" if dspark else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings", 4096)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": V + 1,            # the target's V rows + the mask row
        "draft_vocab_size": V,          # logits over the target's vocabulary (shared LM head)
        "target_hidden_size": int(target_cfg["hidden_size"]),
        "num_target_layers": cfg.target_num_layers,
        "block_size": cfg.block_size,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "torch_dtype": dtype,
        "dflash_config": {
            "mask_token_id": V,
            "target_layer_ids": list(cfg.target_layer_ids),
            "use_aux_hidden_state": True,
        },
        **dspark,
    }


def dspark_heads(state: dict[str, torch.Tensor], cfg, target_embed: torch.Tensor,
                 lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """specload's DSpark heads in vLLM's forms (``qwen3_dspark.py``), float32.

    state: the drafter's tensors (``markov_hidden_term`` off: ``markov.hid.bias`` only);
    target_embed [V, H]; lm_head [V, H] (the target's, or its tied embedding).
    Returns ``markov_head.markov_w1.weight`` [V + 1, r] (silu(P e + b) per token, the
    mask row last), ``markov_head.markov_w2.weight`` [V, r] (W_lm U) and, with a
    confidence head, ``confidence_head.proj.weight`` [1, H + r] / ``.bias`` [1]
    (the Platt calibration folded in).
    """
    f = {k: v.float() for k, v in state.items()}
    emb = torch.cat([target_embed.float(), f["mask_embed"][None]])       # [V + 1, H]
    out = {"markov_head.markov_w1.weight":
           torch.nn.functional.silu(emb @ f["markov.prev.weight"].T + f["markov.hid.bias"]),
           "markov_head.markov_w2.weight": lm_head.float() @ f["markov.out.weight"]}
    if cfg.use_confidence:
        a, b = float(cfg.calib_a), float(cfg.calib_b)
        out["confidence_head.proj.weight"] = a * f["confidence.proj.weight"]
        out["confidence_head.proj.bias"] = a * f["confidence.proj.bias"] + b
    return out


def vllm_state(state: dict[str, torch.Tensor], cfg, target_embed: torch.Tensor,
               dtype: torch.dtype, backbone_only: bool = False,
               lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """specload drafter weights -> vLLM DFlash (or, with vLLM-form DSpark heads, DSpark)
    checkpoint tensors.

    state: the drafter's safetensors; target_embed: the target's embedding [V, H];
    lm_head: the target's LM head [V, H] (default: the embedding, tied).
    Raises VllmExportError for a weight with no vLLM place (unless ``backbone_only``,
    which drops heads and convs).
    """
    out: dict[str, torch.Tensor] = {}
    heads = not backbone_only and vllm_method(cfg) == "dspark" and not differences(cfg)
    for name, w in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = w
        elif name == "mask_embed":
            continue  # the mask row of embed_tokens, below
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            if rest in _LAYER_NAMES:
                out[f"layers.{i}.{_LAYER_NAMES[rest]}"] = w
            elif not (backbone_only and rest.startswith(("conv_attn.", "conv_mlp."))):
                raise VllmExportError(f"weight {name!r} has no place in vLLM's DFlash layer")
        elif name.startswith(_UNUSED_BY_DFLASH) and (cfg.method == "dflash" or backbone_only):
            continue
        elif (backbone_only or heads) and name.startswith(("markov.", "confidence.")):
            continue  # dropped, or re-expressed as a whole below
        else:
            raise VllmExportError(f"weight {name!r} has no place in vLLM's DFlash checkpoint")
    if tuple(target_embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise VllmExportError(f"target embedding {tuple(target_embed.shape)} does not match the "
                              f"drafter's vocab {cfg.vocab_size} x hidden {cfg.hidden_size}")
    out["embed_tokens.weight"] = torch.cat([target_embed.float(),
                                            state["mask_embed"].float()[None]])
    if heads:
        out.update(dspark_heads(state, cfg, target_embed,
                                target_embed if lm_head is None else lm_head))
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def export(drafter: str | Path, out: str | Path, target: str | Path | None = None,
           dtype: str = "float32", backbone_only: bool = False) -> Path:
    """Write the vLLM layout of ``drafter`` into ``out``; returns ``out``.

    Raises FileNotFoundError (no drafter / target files), VllmExportError (a part vLLM
    cannot express, named; ``backbone_only`` exports the backbone instead).
    """
    from safetensors.torch import load_file, save_file

    from actors.drafters.config import DrafterConfig

    src = Path(drafter)
    if not src.is_dir() and (MODELS_DIR / str(drafter)).is_dir():
        src = MODELS_DIR / str(drafter)
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise FileNotFoundError(f"{drafter}: no drafter there (config.json + model.safetensors "
                                f"of a block drafter, or one of models/dflash|dflash2|dspark)")
    cfg = DrafterConfig.from_file(src / "config.json")
    diffs = differences(cfg)
    if diffs and not backbone_only:
        raise VllmExportError(
            f"{src}: {cfg.method} cannot be exported faithfully to vLLM 0.32: "
            + "; ".join(diffs)
            + " (--backbone-only exports its backbone as a plain DFlash drafter instead"
            + ("; `python -m train.drafters --method dspark --vllm-heads` trains DSpark in "
               "vLLM's head forms, which export exactly" if cfg.use_markov else "") + ")")
    tgt = Path(target) if target else MODELS_DIR / "target"
    if not (tgt / "config.json").is_file() or not (tgt / "model.safetensors").is_file():
        raise FileNotFoundError(f"{tgt}: no target model (config.json + model.safetensors)")
    target_cfg = json.loads((tgt / "config.json").read_text())
    cfg.check_target(SimpleNamespace(**target_cfg))
    tstate = load_file(str(tgt / "model.safetensors"))
    embed = next((tstate[k] for k in ("model.embed_tokens.weight", "embed_tokens.weight")
                  if k in tstate), None)
    if embed is None:
        raise VllmExportError(f"{tgt}: no embed_tokens weight in the target checkpoint")
    lm_head = next((tstate[k] for k in ("lm_head.weight", "model.lm_head.weight")
                    if k in tstate), embed)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state = vllm_state(load_file(str(src / "model.safetensors")), cfg, embed, torch_dtype,
                       backbone_only, lm_head)
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    vcfg = vllm_config(cfg, target_cfg, dtype)
    method = vllm_method(cfg) if not backbone_only else "dflash"
    if method == "dflash":   # a backbone-only export of a dspark drafter is a plain DFlash one
        vcfg = vllm_config(replace(cfg, use_markov=False, use_confidence=False), target_cfg,
                           dtype)
    (dst / "config.json").write_text(json.dumps(vcfg, indent=2))
    (dst / "specload_export.json").write_text(json.dumps({
        "source": str(src), "method": cfg.method, "vllm_method": method,
        "num_speculative_tokens": cfg.block_size - 1, "exact": not diffs,
        "dropped": diffs}, indent=2))
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.export_vllm",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="dflash | dflash2 | dspark (models/<name>) or a drafter dir")
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--target", default=None, help="target model dir (default models/target)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weight dtype written (default float32, what the CPU build serves)")
    ap.add_argument("--backbone-only", action="store_true",
                    help="export a dflash2/dspark drafter's backbone as a plain DFlash drafter "
                         "(heads and convs dropped; not the trained method)")
    a = ap.parse_args(argv)
    try:
        dst = export(a.drafter, a.out, a.target, a.dtype, a.backbone_only)
    except (FileNotFoundError, VllmExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    meta = json.loads((dst / "specload_export.json").read_text())
    print(f"wrote {dst} (vLLM method {meta['vllm_method']}, num_speculative_tokens "
          f"{meta['num_speculative_tokens']}, exact: {meta['exact']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
