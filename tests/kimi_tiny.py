"""Tiny Kimi-K2.5-shaped checkpoints (model_type ``kimi_k25``), written the way Moonshot's are: the DeepSeek-V3
language model built by Transformers' own classes (random weights stored bf16, the router's bias fp32) under
``language_model.``, a few vision-tower and projector tensors beside it, config.json with ``text_config`` (model_type
kimi_k2, its quantization_config inside it, as Kimi-K2.5 ships it) and ``vision_config``; the routed experts
quantized to compressed-tensors pack-quantized int4 (symmetric, bf16 scales per group of 32) by compressed-tensors'
own scale rule and compressor when it is installed (``packer="compressed-tensors"``), else by hetmoe's packer
(``packer="own"``: hetmoe.load.compressed.pack_int4, checked against the library in tests/load/test_compressed.py).

``save_kimi_k25`` also writes the reference: the same language model as a plain DeepseekV3ForCausalLM checkpoint in
fp32 holding the stored values, its experts dequantized (q * scale, exact), for Transformers to run.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hetmoe.load.compressed import dequantize, pack_int4, unpack_int4

EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
# Kimi-K2.5's quantization_config (the ignore list also names the vision tower and projector, which it ships beside)
QUANT = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"],
    "kv_cache_scheme": None,
}
# the text model: tests/transformers_tiny.py's deepseek_v3 with 3 layers (layer 0 dense, 1 and 2 MoE)
TEXT = dict(num_hidden_layers=3)
VISION = {"patch_size": 14, "vt_hidden_size": 32, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2,
          "vt_intermediate_size": 64, "merge_kernel_size": [2, 2], "mm_hidden_size": 32, "text_hidden_size": 64}
VISION_TENSORS = {  # a few of MoonViT's and the projector's, small
    "vision_tower.patch_embed.proj.weight": (32, 3, 14, 14), "vision_tower.patch_embed.proj.bias": (32,),
    "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32), "vision_tower.encoder.blocks.0.mlp.fc0.weight": (64, 32),
    "mm_projector.pre_norm.weight": (32,), "mm_projector.proj.0.weight": (128, 128),
    "mm_projector.proj.2.weight": (64, 128),
}


def ct_available() -> bool:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_ct(w: torch.Tensor, group: int) -> dict:
    """compressed-tensors' own quantization of a bf16 weight [out, in]: its min-max scale rule (calculate_qparams)
    and its compressor (PackedQuantizationCompressor.compress): {weight_packed, weight_scale, weight_shape}."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    groups = w.unflatten(-1, (-1, group))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale},
                                                QuantizationScheme(targets=["Linear"], weights=args))
    return {k: out[k] for k in ("weight_packed", "weight_scale", "weight_shape")}


def quantize_own(w: torch.Tensor, group: int) -> dict:
    """The same layout by hetmoe's packer: scale = max |w| / 7.5 per group (bf16), q = round(w / scale) in [-8, 7]."""
    groups = w.float().unflatten(-1, (-1, group))
    scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.clamp(torch.round(groups / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).flatten(-2)
    return {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor(w.shape)}


def ct_decompress(parts: dict, group: int) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's parts (in the scale dtype, as the library gives it)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    return PackedQuantizationCompressor.decompress(dict(parts), QuantizationScheme(targets=["Linear"],
                                                                                  weights=args))["weight"]


def _text_model(seed: int, overrides: dict) -> tuple:
    """(Transformers' config as config.json writes it, the state dict save_pretrained writes: per-expert tensors)."""
    from transformers_tiny import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny("deepseek_v3", tmp, seed=seed, max_shard_size="100MB", overrides={**TEXT, **overrides})
        cfg = json.loads((Path(tmp) / "config.json").read_text())
        state = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(shard))
    return cfg, state


def save_kimi_k25(path, seed: int = 0, packer: str = "compressed-tensors", group: int = 32,
                  overrides: dict | None = None, tokenizer: bool = True, shared_experts: bool = False) -> tuple:
    """Write a tiny kimi_k25 checkpoint to ``path`` (two shards and an index) and its reference to ``path``-ref;
    ``shared_experts``: those pack-quantized too (not in ``ignore``). Returns (checkpoint dir, reference dir,
    {quantized module name: its stored parts})."""
    from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

    path, ref = Path(path), Path(f"{path}-ref")
    path.mkdir(parents=True)
    ref.mkdir(parents=True)
    text_cfg, state = _text_model(seed, overrides or {})
    quantize = quantize_ct if packer == "compressed-tensors" else quantize_own
    stored, reference, parts_of = {}, {}, {}
    for name, t in state.items():
        if EXPERT.fullmatch(name) or (shared_experts and ".shared_experts." in name):
            m = name[:-len(".weight")]
            parts = quantize(t.to(torch.bfloat16), group)
            parts_of[m] = parts
            stored.update({f"language_model.{m}.{k}": v for k, v in parts.items()})
            reference[name] = dequantize(unpack_int4(parts["weight_packed"]), parts["weight_scale"], group)
        else:  # bf16 as Kimi ships them, the router's correction bias fp32 (as DeepSeek-V3's)
            kept = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            stored[f"language_model.{name}"] = kept
            reference[name] = kept.float()
    gen = torch.Generator().manual_seed(seed + 1)
    stored.update({n: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for n, s in VISION_TENSORS.items()})
    names = sorted(stored)  # the vision tower and layers 0-1 in one shard, the rest in the other
    first = [n for n in names if n.startswith(("vision_tower", "mm_projector")) or
             re.match(r"language_model\.model\.layers\.[01]\.", n)]
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": [n for n in names if n not in set(first)]}
    for file, keys in shards.items():
        save_file({k: stored[k].contiguous() for k in keys}, str(path / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    quant = json.loads(json.dumps(QUANT))
    quant["config_groups"]["group_0"]["weights"]["group_size"] = group
    if shared_experts:
        quant["ignore"].remove("re:.*shared_experts.*")
    text = {**text_cfg, "model_type": "kimi_k2", "quantization_config": quant}
    text.pop("transformers_version", None)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                           "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
              "media_placeholder_token_id": 300, "pad_token_id": 0, "use_unified_vision_chunk": True,
              "tie_word_embeddings": False, "text_config": text, "vision_config": VISION}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (ref / "config.json").write_text(json.dumps(text_cfg))
    save_file(reference, str(ref / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        tok = build_tokenizer(text_cfg["vocab_size"])
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(text_cfg["max_position_embeddings"])))
    return path, ref, parts_of
