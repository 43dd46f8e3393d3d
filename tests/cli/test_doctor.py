"""`hetmoe doctor` (hetmoe/cli/doctor.py): its GPU/CUDA line with and without a CUDA device, and one unit (GiB, the
plan's) for every size it prints."""

import re
from types import SimpleNamespace

import torch

from hetmoe.cli import doctor
from hetmoe.cli import main as cli_main


def _doctor(capsys):
    assert cli_main(["doctor", "--threads", "1"]) == 0
    return capsys.readouterr().out.splitlines()


def test_doctor_says_what_gpu_there_is_and_sizes_in_gib(capsys):
    lines = _doctor(capsys)
    gpu = [line for line in lines if line.startswith("gpu:")]
    if torch.cuda.is_available():
        assert len(gpu) == torch.cuda.device_count()
        assert torch.cuda.get_device_name(0) in gpu[0] and "GiB" in gpu[0]
        assert any(line.startswith("cuda:") and torch.version.cuda in line for line in lines)
    else:
        assert len(gpu) == 1 and "no CUDA device" in gpu[0], lines
    memory = next(line for line in lines if line.startswith("memory:"))
    assert re.fullmatch(r"memory: +[0-9.]+ GiB \([0-9.]+ GiB available\), last-level cache [0-9.]+ [MG]iB", memory)
    assert not re.search(r"\d GB\b", "\n".join(lines)), lines  # no decimal GB beside the plan's GiB


def test_gpu_lines_with_a_device(monkeypatch):
    import hetmoe.plan.sysmem as sysmem

    props = SimpleNamespace(name="Fake H100", total_memory=80 << 30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(sysmem, "free_vram", lambda device: 70 << 30)
    lines = doctor.gpu_lines()
    assert lines[:2] == [f"gpu:        cuda:{i} Fake H100, 80.00 GiB (70.00 GiB free), compute capability 9.0"
                         for i in range(2)]
    assert lines[2].startswith(f"cuda:       12.8 (torch {torch.__version__}), ")


def test_gpu_lines_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert doctor.gpu_lines() == [f"gpu:        no CUDA device (torch {torch.__version__} is built without CUDA); "
                                  "everything runs on the CPU"]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "sees none" in doctor.gpu_lines()[0]
