"""The converted-expert cache: the packed routed experts of each MoE layer, saved so the next load skips the
conversion.

One file per layer in a directory named by a hash of what the bytes depend on: the checkpoint (absolute path, and
name, size and modification time of config.json and every shard), the weight format and group size, the expert
shape, and the engine's layout version. A file is written to a temporary name, flushed and renamed, so a crash never
leaves a half-written file under the real name. Reading checks the header against the expected key and sizes and the
data against the 64-bit checksum stored with it; a stale or corrupt file is reported, deleted and rebuilt from the
checkpoint, never used. A write that fails or is interrupted (Ctrl-C, an exception) removes its temporary file; one
left by a process that was killed (``layerNNNN.bin.tmp<pid>``, the pid no longer alive) is removed when the cache is
next opened. Each kind of warning (a file unusable, a write failed) is said once per load, not once per layer; after
a failed write the load writes no more layers. Each directory keeps its key in ``key.json``; when a new one is
written, directories made from an older version of the same checkpoint path (other file sizes or times, another
layout version) are deleted, so re-downloading a model does not leave its old cache behind; so are bf16 directories
keyed by a group size (bf16 has none: its key says group 0 whatever --group-size was).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Optional

from hetmoe import _C, envs

MAGIC = b"HETMOEX1"
DATA_ALIGN = 4096
_TMP = re.compile(r"layer\d+\.bin\.tmp(\d+)")  # a file being written by process <pid>
LAYOUT_KEYS = ("weight_format", "down_weight_format", "group_size", "down_group_size", "gate_up_scaling",
               "down_scaling", "gate_up_scale_dtype", "down_scale_dtype", "gate_up_codebook", "down_codebook")


def default_cache_dir() -> Path:
    base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hetmoe" / "experts"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts: its file is left alone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


class ExpertCache:
    """``said``: the kinds of warning already given in this load, shared by the caches of one load (one per
    experts format) so that each is said once."""

    def __init__(self, root, checkpoint, weight_format: str, group_size: int, warn=print, numa: int = 1,
                 said: Optional[set] = None):
        if weight_format == "bf16":  # no scale groups: a group size given with bf16 changes no byte
            group_size = 0
        key = {
            "checkpoint": str(Path(checkpoint.path).resolve()),
            "files": checkpoint.fingerprint(),
            "format": weight_format,
            "group_size": group_size,
            "layout_version": _C.LAYOUT_VERSION,
        }
        if numa > 1:  # experts split over NUMA subpools store their slices one after another (csrc/moe/split_experts.h)
            key["numa_subpools"] = numa
        self.key = json.loads(json.dumps(key))  # as it reads back from a file header (tuples become lists)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        split = f"-numa{numa}" if numa > 1 else ""
        self.dir = Path(root) / f"{Path(checkpoint.path).name}-{weight_format}-g{group_size}{split}-{digest}"
        self.warn = warn
        self.said = set() if said is None else said
        self.hits = self.misses = self.rebuilt = self.unwritten = 0
        self.write_failed = False
        self.remove_orphans()

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self.said:
            self.said.add(kind)
            self.warn(message)

    def remove_orphans(self) -> list:
        """Delete the temporary files (``layerNNNN.bin.tmp<pid>``) of writers that are no longer alive: a process
        killed during a write. A live writer's file is left alone. Returns the paths removed."""
        removed = []
        try:
            names = os.listdir(self.dir)
        except OSError:  # no directory yet (or unreadable: a write will say so)
            return removed
        for name in names:
            m = _TMP.fullmatch(name)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            try:
                (self.dir / name).unlink()
                removed.append(self.dir / name)
            except OSError:
                pass
        if removed:
            self._warn_once("orphans", f"removed {len(removed)} unfinished expert cache file(s) in {self.dir} left "
                                       "by a process that was interrupted")
        return removed

    def _path(self, layer: int) -> Path:
        return self.dir / f"layer{layer:04d}.bin"

    def _header(self, layer: int, experts) -> dict:
        info = experts.info()
        slices = info["numa_slices"]
        # the layer's own code layout (a GGUF layer may hold its types exactly: formats, scalings, scale dtypes and
        # codebooks of their own, in bytes of the same size as another layout's)
        layout = {k: info.get(k) for k in LAYOUT_KEYS}
        return {**self.key, "layer": layer, "shape": [experts.num_experts, experts.hidden_size,
                                                      experts.intermediate_size],
                "layout": layout, "sizes": [m.nbytes for m in experts.storage()],
                **({"numa_slices": [list(b) for b in slices]} if len(slices) > 1 else {})}

    def load(self, layer: int, experts) -> bool:
        """Fill ``experts`` from the cache; False when there is no valid entry (a bad one is removed)."""
        path = self._path(layer)
        if not path.is_file():
            self.misses += 1
            return False
        want = self._header(layer, experts)
        try:
            with open(path, "rb") as f:
                if f.read(8) != MAGIC:
                    raise ValueError("not a hetmoe expert cache file")
                (n,) = struct.unpack("<I", f.read(4))
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
                checksum = header.pop("checksum")
                if header != want:
                    raise ValueError("it was made from other files or settings")
                f.seek(DATA_ALIGN * -(-(12 + n) // DATA_ALIGN))
                for view in experts.storage():
                    if f.readinto(view) != view.nbytes:
                        raise ValueError("it is truncated")
                if f.read(1):
                    raise ValueError("it has trailing bytes")
            if experts.checksum() != checksum:
                raise ValueError("its data does not match its checksum")
        except (OSError, ValueError, KeyError, json.JSONDecodeError, struct.error) as err:
            self._warn_once("unusable", f"expert cache {path} is unusable ({err}); rebuilding it from the checkpoint"
                                        " (the load summary counts any other layer rebuilt)")
            path.unlink(missing_ok=True)
            self.rebuilt += 1
            return False
        experts.mark_loaded()
        self.hits += 1
        return True

    def save(self, layer: int, experts) -> Optional[Path]:
        """Write the layer atomically. A failure (e.g. a full disk) is reported once and leaves no file behind, and
        no later layer of this load is written; an interrupt (KeyboardInterrupt, any exception) also removes the
        temporary file before it propagates."""
        if self.write_failed:
            self.unwritten += 1
            return None
        path = self._path(layer)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        header = json.dumps({**self._header(layer, experts), "checksum": experts.checksum()}).encode()
        try:
            if not self.dir.is_dir():
                self.dir.mkdir(parents=True)
                (self.dir / "key.json").write_text(json.dumps(self.key, indent=1))
                self._prune_stale()
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(b"\0" * (DATA_ALIGN * -(-(12 + len(header)) // DATA_ALIGN) - 12 - len(header)))
                for view in experts.storage():
                    f.write(view)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return path
        except OSError as err:
            self._remove(tmp)
            self.write_failed = True
            self.unwritten += 1
            self._warn_once("write", f"could not write the expert cache {path} ({err}); continuing without it "
                                     "(no other layer of this load is written)")
            return None
        except BaseException:
            self._remove(tmp)
            raise

    @staticmethod
    def _remove(tmp: Path) -> None:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass

    def _prune_stale(self) -> None:
        """Delete cache directories of an older version of this checkpoint path."""
        for other in self.dir.parent.iterdir():
            if other == self.dir or not (other / "key.json").is_file():
                continue
            try:
                key = json.loads((other / "key.json").read_text())
                # bf16 entries keyed by a group size were written before the group was normalised out of the
                # key: the same bytes as the group-0 entry
                stale = (key.get("checkpoint") == self.key["checkpoint"]
                         and (key.get("files") != self.key["files"]
                              or key.get("layout_version") != self.key["layout_version"]
                              or (key.get("format") == "bf16" and key.get("group_size"))))
            except (OSError, ValueError, AttributeError):
                continue
            if stale:
                size = sum(f.stat().st_size for f in other.iterdir() if f.is_file())
                shutil.rmtree(other, ignore_errors=True)
                self.warn(f"removed the expert cache of an older version of this checkpoint: {other} "
                          f"({size / 2**30:.2f} GiB)")
