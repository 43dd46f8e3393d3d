"""The memory plan on budgets: sizes, --dense-format auto, --gpu-memory / --cpu-memory, --gpu-experts
auto, --max-context auto, the table, and `hetmoe plan`. Every plan is made from meta-device models, on the CPU; a
GPU is planned for without being here (``device=cuda`` given to plan_model, as `hetmoe plan --device cuda` does)."""

import re

import pytest
import torch

from hetmoe.config.formats import DENSE_FORMATS
from hetmoe.config.options import EngineOptions
from hetmoe.config.units import gib, parse_size
from hetmoe.load.loader import build_meta, moe_blocks, plan_model
from hetmoe.load.random_weights import shape_config
from hetmoe.load.shapes import model_shapes
from hetmoe.plan import placement
from hetmoe.plan.memory import PlanError
from hetmoe.plan.placement import dense_bytes

CUDA = torch.device("cuda")
GiB = 1 << 30
BIG_RAM = "4TiB"  # RAM budget for the full shapes: their routed experts do not fit this machine




def _plan(model, device=CUDA, **opts):
    cfg, meta, blocks, inter = model
    return plan_model(meta, cfg, blocks, EngineOptions(**{"cpu_memory": BIG_RAM, **opts}), inter, device)


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, n", [("24GiB", 24 * GiB), ("24G", 24 * GiB), ("24g", 24 * GiB), ("500MiB", 500 << 20),
                                     ("1.5TB", 1_500_000_000_000), ("2GB", 2_000_000_000), ("1048576", 1 << 20),
                                     (" 8 GiB ", 8 * GiB), ("64k", 65536), (".5G", GiB // 2), (GiB, GiB),
                                     ("500B", 500), ("1048576.0", 1 << 20)])
def test_sizes(text, n):
    assert parse_size(text) == n
    assert EngineOptions(gpu_memory=text, cpu_memory=text).gpu_memory == n


@pytest.mark.parametrize("text", ["", "G", "24XB", "-1G", "0", "1.2.3G", "1e9", "24 GiBs", True, None, 1.5])
def test_bad_sizes_are_clear_errors(text, capsys):
    with pytest.raises(ValueError, match=r"--gpu-memory: expected a size such as 24GiB, 24G, 500MiB, 1\.5TB"):
        EngineOptions(gpu_memory=text) if text is not None else parse_size(text, "--gpu-memory")
    if isinstance(text, str) and text:
        from hetmoe.cli import main

        with pytest.raises(SystemExit) as exit:
            main(["plan", f"--cpu-memory={text}"])
        err = capsys.readouterr().err.splitlines()[-1]
        assert exit.value.code == 2 and err == f"hetmoe plan: error: --cpu-memory: expected a size such as 24GiB, " \
                                               f"24G, 500MiB, 1.5TB or a number of bytes, got {text}", err


@pytest.mark.parametrize("value", ["24", 24, " 80 ", "0.5", "1048575", 4096])
def test_a_bare_number_below_1_mib_is_a_forgotten_unit(value, capsys):
    """--gpu-memory 24 meant 24 GiB, not 24 bytes: refused with the unit suggested (a unit given is taken as is)."""
    text = str(value).strip()
    with pytest.raises(ValueError, match=rf"--gpu-memory: {text} bytes is too small; did you mean {text}GiB\?"):
        EngineOptions(gpu_memory=value)
    if isinstance(value, str):
        from hetmoe.cli import main

        for flag in ("--gpu-memory", "--cpu-memory"):
            with pytest.raises(SystemExit) as exit:
                main(["plan", f"{flag}={value}"])
            err = capsys.readouterr().err.splitlines()[-1]
            assert exit.value.code == 2 and f"{flag}: {text} bytes is too small; did you mean {text}GiB?" in err, err


def test_auto_values_parse():
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_options

    args = build_parser().parse_args(["plan", "--gpu-experts", "auto", "--max-context", "auto"])
    assert engine_options(args) == EngineOptions(gpu_experts="auto")
    assert EngineOptions(max_context="auto").max_context is None  # auto is the default
    with pytest.raises(ValueError, match="gpu-experts must be auto or an integer >= 0"):
        EngineOptions(gpu_experts="all")


# ---------------------------------------------------------------- the dense format


def test_dense_bytes_count_each_format(deepseek):
    cfg, model, _, _ = deepseek
    shapes = model_shapes(model, cfg, 2048)
    packed = sum(n * k for n, k in shapes.dense_linears)
    assert 0.8 * shapes.dense_params < packed < shapes.dense_params  # embeddings, kv_b_proj, routers stay
    assert dense_bytes(shapes, "bf16", 2) == shapes.dense_params * 2
    for name in ("fp8", "int8", "int4"):
        fmt = DENSE_FORMATS[name]
        want = sum(fmt.nbytes(n, k) for n, k in shapes.dense_linears) + (shapes.dense_params - packed) * 2
        assert dense_bytes(shapes, name, 2) == want
    assert dense_bytes(shapes, "int4", 2) < dense_bytes(shapes, "int8", 2) < dense_bytes(shapes, "bf16", 2)


def test_deepseek_v3_fits_24_gib_with_fp8_or_int4_dense(deepseek):
    plan = _plan(deepseek, gpu_memory="24GiB", max_context=32768)
    assert plan.dense_format in ("fp8", "int4") and plan.max_context == 32768
    assert plan.vram_bytes <= 24 * GiB
    assert plan.vram["dense weights"] == dense_bytes(model_shapes(deepseek[1], deepseek[0], 2048),
                                                     plan.dense_format, 2)
    assert "bf16" in plan.why["dense weights"] and "> 24.00 GiB" in plan.why["dense weights"]
    # forced bf16: refused with its numbers, the table in the message
    bf16 = dense_bytes(model_shapes(deepseek[1], deepseek[0], 2048), "bf16", 2)
    with pytest.raises(PlanError) as err:
        _plan(deepseek, gpu_memory="24GiB", max_context=32768, dense_format="bf16")
    text = str(err.value)
    assert f"the dense weights alone (bf16) need {gib(bf16)}" in text and "--dense-format int4" in text
    assert re.search(rf"dense weights \(bf16\) +cuda +{gib(bf16)}  --dense-format bf16", text), text
    assert "VRAM total" in text and "DOES NOT FIT: 24.00 GiB budget (--gpu-memory)" in text
    assert isinstance(err.value, MemoryError) and err.value.plan.dense_format == "bf16"


def test_a_budget_below_int4_dense_is_refused_naming_the_dense_bytes(deepseek):
    int4 = dense_bytes(model_shapes(deepseek[1], deepseek[0], 2048), "int4", 2)
    with pytest.raises(MemoryError, match=rf"the dense weights alone \(int4\) need {gib(int4)}"):
        _plan(deepseek, gpu_memory="8GiB", max_context=4096)


def test_auto_dense_steps_down_only_as_far_as_it_must(qwen):
    precise = _plan(qwen, gpu_memory="80GiB", max_context=32768)
    assert precise.dense_format == "bf16" and precise.why["dense weights"] == "auto: the most precise; fits"
    # (the optional layerwise prefill buffers come after the dense choice: off here, to compare plans like for like)
    plans = {f: _plan(qwen, gpu_memory="80GiB", max_context=32768, dense_format=f, gpu_prefill="off")
             for f in DENSE_FORMATS}
    assert plans["bf16"].vram_bytes > plans["int8"].vram_bytes > plans["fp8"].vram_bytes > plans["int4"].vram_bytes
    for budget in sorted({p.vram_bytes + d for p in plans.values() for d in (-1, 0)})[1:]:  # int4's - 1: refused
        # the most precise that fits (int8, a scale per 64, is larger than fp8: chosen only where fp8 cannot run)
        want = next((f for f in placement.DENSE_ORDER if plans[f].vram_bytes <= budget), "int4")
        assert _plan(qwen, gpu_memory=budget, max_context=32768, gpu_prefill="off").dense_format == want, budget


def test_cpu_placement_dense_format(deepseek, qwen):
    cpu = torch.device("cpu")
    assert _plan(deepseek, cpu).dense_format == "int8"  # decode on a CPU reads every dense byte from DRAM
    assert _plan(qwen, cpu).dense_format == "int8"
    with pytest.raises(ValueError, match=r"dense format fp8 does not run on cpu \(it runs on: cuda\)"):
        _plan(qwen, cpu, dense_format="fp8")


def _shape_plan(name, layers=None, **opts):
    cfg = shape_config(name, layers)
    model = build_meta(cfg)
    options = EngineOptions(**{"device": "cpu", "cpu_memory": BIG_RAM, **opts})
    inter = cfg.get("moe_intermediate_size") or cfg.intermediate_size
    return plan_model(model, cfg, moe_blocks(model), options, inter, torch.device("cpu"))


def test_cpu_dense_auto_is_decided_by_the_bytes_a_token_reads():
    """--dense-format auto on the CPU: the dtype's own weights only where they cost a decode token little (within
    the caches, or under 10% of its bytes against the experts'), else int8 — whatever the parameter count."""
    # 4 layers of Qwen3-30B-A3B: < 1 G dense parameters, so fp32; its lm_head alone is 1.2 GB read per token in
    # fp32 (1,636 MB in all against 500 MB in int8; measured 10.7 against 48.3 tok/s): int8
    few = _shape_plan("qwen3-30b-a3b", 4, experts_format="int4")
    assert (few.dense_format, few.dtype) == ("int8", torch.float32), few.why["dense weights"]
    assert "int8" not in few.why["dense weights"] and "fp32" in few.why["dense weights"]  # the table names int8
    # the built-in model: 15 MB of fp32 dense weights per token stay in the caches (it decodes faster so)
    from hetmoe.engine.llm import default_model_path
    from hetmoe.load.loader import check_model_dir

    cfg = check_model_dir(default_model_path())
    model = build_meta(cfg)
    demo = plan_model(model, cfg, moe_blocks(model), EngineOptions(device="cpu"), cfg.moe_intermediate_size,
                      torch.device("cpu"))
    assert (demo.dense_format, demo.dtype) == ("bf16", torch.float32) and "caches" in demo.why["dense weights"]
    # Mixtral's bf16 experts read 22.5 GB per token: int8 dense would save 1.4 GB of them (6%), so bf16 stays;
    # against int4 experts (6 GB) the same 1.4 GB is 16%: int8
    assert _shape_plan("mixtral-8x7b", experts_format="bf16").dense_format == "bf16"
    assert _shape_plan("mixtral-8x7b", experts_format="int4").dense_format == "int8"
    # an experts format left to auto: the dense format is decided with the experts format each candidate plan has
    auto = _shape_plan("mixtral-8x7b")
    assert auto.experts_format == "bf16" and auto.dense_format == "bf16"
    # asked for: as asked, and the table names fp32 weights by their dtype
    asked = _shape_plan("qwen3-30b-a3b", 4, experts_format="int4", dense_format="bf16")
    assert asked.dense_format == "bf16" and "dense weights (fp32)" in "\n".join(asked.table())
    assert placement.dense_name("bf16", torch.float32) == "fp32" and placement.dense_name("int8", torch.float32) == \
        "int8" and placement.dense_name("bf16", torch.bfloat16) == "bf16"


# ---------------------------------------------------------------- budgets, GPU experts, context


@pytest.mark.parametrize("budget", ["24GiB", "40GiB", "64GiB", "141GiB"])
def test_gpu_experts_auto_fills_and_never_exceeds_the_budget(qwen, budget):
    plan = _plan(qwen, gpu_memory=budget, max_context=32768, gpu_experts="auto")
    limit = parse_size(budget)
    E, each = 128, 3 * 2048 * 768 * 2
    n = {lp.gpu_experts for lp in plan.layers}
    assert len(n) == 1 and plan.vram["GPU experts"] == n.pop() * 48 * each == sum(lp.vram for lp in plan.layers)
    N = plan.layers[0].gpu_experts
    assert plan.vram_bytes <= limit and N > 0
    # one more per layer would not fit beside the margin the planner keeps
    assert N == E or plan.vram_bytes + 48 * each > limit - placement.RESIDENT_MARGIN
    assert f"GPU experts ({N} per layer, bf16)" in "\n".join(plan.table())  # bf16 experts: bf16 copies
    zero = _plan(qwen, gpu_memory=budget, max_context=32768)
    assert zero.vram["GPU experts"] == 0 and zero.dense_format == plan.dense_format


def test_gpu_experts_auto_is_capped_at_the_experts_per_layer(qwen):
    plan = _plan(qwen, gpu_memory="1TiB", max_context=4096, gpu_experts="auto")
    assert [lp.gpu_experts for lp in plan.layers] == [128] * 48 and "(all)" in plan.why["GPU experts"]


def test_gpu_experts_auto_all_resident_when_the_whole_model_fits(qwen, capsys):
    """Dense 2.87 GiB + int4 experts 15.19 GiB + a 32K KV cache fit 24 GiB: every expert resident and no layerwise
    prefill buffers (no layer is left to stream), not a share of the experts traded for streaming slots."""
    opts = dict(gpu_memory="24GiB", max_context=32768, gpu_experts="auto", experts_format="int4")
    plan = _plan(qwen, **opts)
    assert [lp.gpu_experts for lp in plan.layers] == [128] * 48 and not plan.gpu_prefill
    assert not any(plan.vram.get(k) for k in ("prefill slots", "prefill weights", "prefill activations"))
    assert plan.vram["GPU experts"] == 48 * 128 * plan.layers[0].gpu_expert_bytes and plan.vram_bytes <= 24 * GiB
    assert "the whole model fits" in plan.why["GPU experts"] and plan.why["prefill slots"].startswith("none: every")
    code, out, err = _cli(capsys, "plan", "--shape", "qwen3-30b-a3b", "--device", "cuda", "--gpu-memory", "24GiB",
                          "--gpu-experts", "auto", "--experts-format", "int4", "--max-context", 32768,
                          "--cpu-memory", BIG_RAM)
    assert code == 0, err
    assert re.search(r"GPU experts \(128 per layer, int4\) +cuda +15\.19 GiB +auto: 128 of 128 per layer \(all\)", out)
    assert re.search(r"prefill slots +cuda +0\.0 MiB +none: every routed expert is resident", out), out
    assert "prefill weights" not in out and "fits: 24.00 GiB budget" in out
    # every prefill runs on the resident experts: chunks as long as their activations fit (each chunk unpacks
    # every layer's experts once), shorter under a tighter budget
    base = EngineOptions().prefill_chunk
    assert plan.prefill_chunk > base and f"chunks of {plan.prefill_chunk} tokens" in plan.why["resident prefill"]
    shapes = model_shapes(qwen[1], qwen[0], qwen[3])
    least = sum(placement.resident_prefill_bytes(shapes, 128, base, 2))
    # one byte short of every expert (with the margin) at the shortest chunk: the choice goes back to the cost model
    need = plan.vram_bytes - plan.vram["resident prefill"] + least + placement.RESIDENT_MARGIN
    short = _plan(qwen, **{**opts, "gpu_memory": need - 1})
    assert short.layers[0].gpu_experts < 128 and "by modelled value" in short.why["GPU experts"]
    assert _plan(qwen, **{**opts, "gpu_memory": need}).layers[0].gpu_experts == 128


@pytest.mark.parametrize("budget", ["11GiB", "16GiB", "20GiB", "23.5GiB"])
def test_gpu_experts_auto_chooses_by_modelled_value(qwen, budget, capsys):
    """Experts that do not all fit: resident experts alone against prefill buffers + fewer experts, the higher
    modelled value (geometric mean of decode and prefill tok/s) chosen, both candidates and the numbers printed."""
    opts = dict(gpu_memory=budget, max_context=32768, gpu_experts="auto", experts_format="int4")
    plan = _plan(qwen, **opts)
    n, limit = plan.layers[0].gpu_experts, parse_size(budget)
    assert 0 < n < 128 and plan.vram_bytes <= limit
    assert plan.gpu_prefill == (budget != "23.5GiB")  # near the whole model, the experts are worth more
    off = _plan(qwen, **opts, gpu_prefill="off")  # experts only: the most that fit beside the margin
    shapes = model_shapes(qwen[1], qwen[0], qwen[3])
    # one more resident expert per layer: its bytes in 48 layers, and one more in the resident prefill's scratch
    per = 48 * off.layers[0].gpu_expert_bytes + placement.resident_prefill_bytes(shapes, 1, off.prefill_chunk, 2)[0]
    m = off.layers[0].gpu_experts
    assert not off.gpu_prefill and off.vram_bytes + per > limit - placement.RESIDENT_MARGIN >= off.vram_bytes
    assert "--gpu-prefill off" in off.why["GPU experts"]
    value = lambda r: (r[0] * r[1]) ** 0.5  # noqa: E731
    chosen = value(placement.modelled_rates(plan, shapes, n, plan.prefill_chunk if plan.gpu_prefill else None))
    assert chosen >= value(placement.modelled_rates(off, shapes, m, None))
    if plan.gpu_prefill:  # buffers were worth more than the experts they displace
        assert m > n and plan.vram["prefill slots"] > 0
        assert f"{n}/128 resident with prefill chunks of {plan.prefill_chunk} on the GPU" in plan.why["GPU experts"]
        assert f"over {m}/128 resident with no GPU prefill buffers" in plan.why["GPU experts"]
    else:
        assert n == m and plan.why["prefill slots"].startswith("none: resident experts are worth more")
        assert f"{n}/128 resident with no GPU prefill buffers" in plan.why["GPU experts"]
        assert re.search(r"over \d+/128 resident with prefill chunks of \d+ on the GPU", plan.why["GPU experts"])
    # more resident experts are always modelled faster to decode; the layerwise prefill faster on long prompts
    d0, p0 = placement.modelled_rates(plan, shapes, 0, None)
    d1, p1 = placement.modelled_rates(plan, shapes, 64, None)
    assert d1 > d0 and p1 > p0 and placement.modelled_rates(plan, shapes, 0, 8192)[1] > p0
    code, out, err = _cli(capsys, "plan", "--shape", "qwen3-30b-a3b", "--device", "cuda", "--gpu-memory", budget,
                          "--gpu-experts", "auto", "--experts-format", "int4", "--max-context", 32768,
                          "--cpu-memory", BIG_RAM)
    assert code == 0 and f"GPU experts ({n} per layer, int4)" in out and "by modelled value" in out, err


def test_gpu_prefill_count_keeps_its_buffers_with_auto_experts(qwen):
    """--gpu-prefill N asks for the layerwise prefill: auto experts fill what its buffers leave, even where every
    expert would fit without them."""
    plan = _plan(qwen, gpu_memory="24GiB", max_context=32768, gpu_experts="auto", experts_format="int4",
                 gpu_prefill=512)
    assert plan.gpu_prefill and plan.vram["prefill slots"] > 0 and 0 < plan.layers[0].gpu_experts < 128
    assert plan.vram_bytes <= 24 * GiB


def test_max_context_auto_fills_the_budget(deepseek):
    plan = _plan(deepseek, gpu_memory="24GiB")
    assert plan.max_context % 1024 == 0 and 4096 <= plan.max_context < 163840 and plan.vram_bytes <= 24 * GiB
    assert any("not the model's 163840" in n for n in plan.notes)
    assert plan.dense_format == "fp8"  # precision first: the dense format is chosen for 4096 positions
    assert _plan(deepseek, gpu_memory="24GiB", max_context="auto").max_context == plan.max_context


def test_budgets_replace_what_is_free_and_warn_above_it(qwen, monkeypatch):
    monkeypatch.setattr(placement, "free_ram", lambda: 16 * GiB)
    plan = _plan(qwen, torch.device("cpu"), cpu_memory="8TiB", gpu_memory="24GiB")
    assert plan.budgets["RAM"][0] == 8 << 40
    assert any("--cpu-memory 8192.00 GiB is more than the 16.00 GiB available" in n for n in plan.notes)
    assert any("--gpu-memory 24.00 GiB does not apply: the placement is CPU-only" in n for n in plan.notes)
    with pytest.raises(PlanError, match=r"RAM: needs [0-9.]+ GiB, 16.00 GiB available") as err:
        plan_model(qwen[1], qwen[0], qwen[2], EngineOptions(device="cpu", experts_format="int4"), 768,
                   torch.device("cpu"))
    assert "DOES NOT FIT: 14.72 GiB budget (92% of 16.00 GiB available)" in " ".join(str(err.value).split())
    with pytest.raises(ValueError, match="a GPU this machine does not have.*--gpu-memory SIZE"):
        _plan(qwen)


def test_table_rows_and_width(deepseek):
    plan = _plan(deepseek, gpu_memory="24GiB", max_context=32768, gpu_experts="auto", max_batch=4)
    lines = plan.table(90)
    assert all(len(line) <= 90 for line in lines), lines
    text = "\n".join(lines)
    for row in (f"dense weights ({plan.dense_format})", "KV cache (32768 x ", "activations", "CUDA context",
                "GPU experts (0 per layer)", "VRAM total", "routed experts (", "runtime", "RAM total"):
        assert row in text, (row, text)
    assert lines[0].split() == ["part", "on", "bytes", "why"]


# ---------------------------------------------------------------- hetmoe plan


def _cli(capsys, *args):
    from hetmoe.cli import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command(capsys):
    args = ("plan", "--shape", "deepseek-v3", "--device", "cuda", "--max-context", 32768, "--cpu-memory", BIG_RAM)
    code, out, err = _cli(capsys, *args, "--gpu-memory", "24GiB")
    assert code == 0 and err == "", err
    assert out.startswith("deepseek-v3 shape: deepseek_v3, 61 layers (58 MoE)")
    assert re.search(r"dense weights \((fp8|int4)\) +cuda", out) and "fits: 24.00 GiB budget (--gpu-memory)" in out
    code, out, err = _cli(capsys, *args, "--gpu-memory", "8GiB")
    assert code == 1 and "DOES NOT FIT" in out and "dense weights (int4)" in out
    assert err.startswith("hetmoe plan: does not fit: the model does not fit") and "dense weights alone" in err
    if not torch.cuda.is_available():  # planning for a GPU that is not here: its size must be given
        code, out, err = _cli(capsys, *args)
        assert code == 1 and out == "" and "--gpu-memory SIZE" in err and err.startswith("hetmoe plan: error:")
    code, out, err = _cli(capsys, "plan", "--shape", "qwen3-30b-a3b", "--layers", 2, "--device", "cpu")
    assert code == 0 and "qwen3_moe, 2 layers (2 MoE)" in out and "RAM total" in out and "VRAM" not in out


def test_plan_command_reads_a_checkpoint(capsys):
    from hetmoe.engine.llm import default_model_path

    code, out, err = _cli(capsys, "plan", "--device", "cpu", "--experts-format", "int4")  # the built-in model
    assert code == 0 and out.startswith(f"{default_model_path()}: deepseek_v3, 6 layers (5 MoE)"), err
    assert "routed experts (int4, group 64)" in out and "dense weights (fp32)" in out
    code, _, err = _cli(capsys, "plan", "--shape", "deepseek-v3", "--model", default_model_path())
    assert code == 1 and "--model and --shape name two models" in err


def test_plan_command_reads_a_gguf_file(capsys, tmp_path):
    pytest.importorskip("gguf")
    from gguf_files import hetmoe_state, hf_config, to_gguf_tensors, write_gguf

    cfg = hf_config("qwen3_moe")
    path = write_gguf(tmp_path / "tiny.gguf", "qwen3_moe", cfg, to_gguf_tensors("qwen3_moe", cfg,
                                                                                 hetmoe_state("qwen3_moe", cfg)))
    code, out, err = _cli(capsys, "plan", "--model", path, "--device", "cpu", "--experts-format", "int8")
    assert code == 0 and out.startswith(f"{path}: qwen3_moe, {cfg['num_hidden_layers']} layers"), err
    assert "routed experts (int8, group 128)" in out and "RAM total" in out


@pytest.mark.parametrize("name,bits", [("mxfp4", 4.25), ("q4_k_m", None), ("iq2_xxs", 2.0625), ("fp8", None)])
def test_plan_shape_experts_as_a_checkpoint_ships_them(capsys, name, bits):
    """--shape-experts: every MoE layer planned in the checkpoint format's own layout; the RAM of the routed experts
    is what the engine allocates for that layout (layout_bytes), for MXFP4 4.25 bits and IQ2_XXS 2.0625 bits a
    weight as in the file."""
    from hetmoe.cli.plan import checkpoint_formats
    from hetmoe.cpu.layout import layout_bytes

    args = ("plan", "--shape", "deepseek-v4-flash", "--layers", 4, "--device", "cpu", "--cpu-memory", BIG_RAM)
    code, out, err = _cli(capsys, *args, "--shape-experts", name)
    assert code == 0 and out.startswith(f"deepseek-v4-flash shape, experts as {name}:"), err
    cfg = shape_config("deepseek-v4-flash", 4)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    want = 4 * E * layout_bytes(checkpoint_formats()[name], H, I)
    row = re.search(r"routed experts \(\w+, group \d+\) +cpu +([\d.]+) GiB +the checkpoint's own codes", out)
    assert row and abs(float(row.group(1)) - want / 2**30) < 0.006, (row and row.group(0), want / 2**30)
    if bits is not None:
        assert abs(want / (4 * E * 3 * H * I) * 8 - bits) < 1e-9
    for bad, message in ((("--shape-experts", "q9_z"), "not a checkpoint format hetmoe holds exactly"),
                         (("--shape-experts", name, "--experts-format", "int8"), "leave --experts-format"),
                         (("--shape-experts", name, "--group-size", "32"), "leave --experts-format and --group-size")):
        code, _, err = _cli(capsys, *args, *bad)
        assert code == 1 and message in err, err
    code, _, err = _cli(capsys, "plan", "--device", "cpu", "--shape-experts", name)
    assert code == 1 and "--shape-experts applies to --shape only" in err


# published total parameters (billions) of the full-size shapes
PUBLISHED_B = {"deepseek-v3.2": 671, "glm-5": 744, "qwen3.5-397b-a17b": 397, "qwen3-next-80b-a3b": 80,
               "gpt-oss-120b": 117, "glm-4.5-air": 106, "minimax-m2.5": 229}


@pytest.mark.parametrize("shape", list(PUBLISHED_B))
def test_full_size_shapes_have_their_published_size_and_plan(capsys, shape):
    """Each preset builds (meta device) to its model's published parameter count within 1%, and plans on a 24 GiB GPU
    with 256 GiB of RAM."""
    code, out, err = _cli(capsys, "plan", "--shape", shape, "--device", "cuda", "--gpu-memory", "24GiB",
                          "--cpu-memory", "256GiB")
    assert code == 0, err
    dense, routed = map(float, re.search(r"([\d.]+) G dense \+ ([\d.]+) G routed", out).groups())
    assert abs(dense + routed - PUBLISHED_B[shape]) / PUBLISHED_B[shape] < 0.01, (dense, routed)


@pytest.mark.parametrize("shape,context,experts", [("deepseek-v4-flash", 131072, "mxfp4"),
                                                   ("qwen3.5-397b-a17b", 262144, None)])
def test_frontier_models_fit_a_24_gib_gpu_and_256_gib_with_gpu_prefill(capsys, shape, context, experts):
    """DeepSeek-V4-Flash with its MXFP4 experts at 128K and Qwen3.5-397B at 256K fit 24 GiB + 256 GiB with the
    layerwise GPU prefill planned."""
    code, out, err = _cli(capsys, "plan", "--shape", shape, "--device", "cuda", "--gpu-memory", "24GiB",
                          "--cpu-memory", "256GiB", "--max-context", context,
                          *(("--shape-experts", experts) if experts else ()))
    assert code == 0, err
    assert f"KV cache ({context} x 1)" in out and "prefill slots" in out and "fits: 24.00 GiB budget" in out
    assert "fits: 256.00 GiB budget" in out


# ---------------------------------------------------------------- recurrent (linear-attention) states


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_recurrent_states_are_planned_per_slot(device):
    """A Qwen3-Next-shape model (3 linear-attention layers per full-attention one): the plan counts the runner's
    recurrent states — conv windows in the model dtype, fp32 states — once per sequence slot, apart from the KV
    cache, on the device that holds the cache."""
    transformers = pytest.importorskip("transformers")
    from transformers_tiny import COMMON, FAMILIES

    _, extra = FAMILIES["qwen3_next"]
    config = transformers.Qwen3NextConfig(**{**COMMON, **extra, "num_hidden_layers": 4,
                                             "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    cfg = shape_config(config.to_dict())
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    opts = dict(max_context=256, dtype="bf16", gpu_memory="8GiB")
    plans = {batch: plan_model(model, cfg, blocks, EngineOptions(max_batch=batch, **opts), cfg.moe_intermediate_size,
                               torch.device(device)) for batch in (1, 3)}
    for batch, plan in plans.items():
        where = plan.vram if device == "cuda" else plan.ram
        states = model.make_cache(batch, 1, dtype=torch.bfloat16, device="meta").states
        assert where["recurrent states"] == states.bytes_allocated > 0
        assert "recurrent states" not in (plan.ram if device == "cuda" else plan.vram)
        assert any(line.lstrip().startswith("recurrent states (x") for line in plan.table())
    assert plans[3].ram_bytes + plans[3].vram_bytes > plans[1].ram_bytes + plans[1].vram_bytes


def test_attention_only_models_plan_no_states(qwen):
    plan = _plan(qwen, gpu_memory="80GiB", max_context=4096)
    assert "recurrent states" not in plan.vram and "recurrent states" not in plan.ram
