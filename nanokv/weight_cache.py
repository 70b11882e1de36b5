"""The converted, packed weights of a model, cached on disk and mapped read-only on the next load.

Loading a checkpoint costs far more than running it once: a GGUF is dequantized tensor by
tensor, q/k rows are permuted back, and every projection is packed into the C kernels'
panels (layers/custom_op.py). What comes out depends only on the checkpoint, the config
derived from it, the dtype, the kernel choice (weight and LM head formats) and the code
that converts and packs. So after the first load the model's tensors, as the kernels read
them, are written to one file under `weights/` in nanokv's cache root (kernels/build.py:
$NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv or ~/.cache/nanokv), and a later load of
the same model maps that file read-only (no copy: the pages are the page cache's, shared
by every process that maps the entry) and packs nothing.

The entry's name is keyed by: each weight file's path, size, mtime, ctime (which no user
can set back: a file rewritten in place is a new key), inode and a hash of its first and
last MiB (a safetensors header, a GGUF's metadata), the model config, the dtype, the
kernel choice, the torch and gguf versions, nanokv's version and the source of the modules
that load and pack weights (a change to them is a new key). Writing an entry removes the
oldest of the same model file's beyond KEEP_ENTRIES; deleting the `weights` folder clears
them all.

Robustness, as the GGUF config cache and the kernel build have it:
- an entry is written whole or not at all (a temporary file, then a rename);
  two processes building it at once each write their own temporary file, and the one
  renamed last stays: the same bytes either way;
- an entry is trusted only when its header parses, the file has exactly the size the
  header says, and the xxh3 of its data equals the one recorded (a truncated entry, a
  flipped byte: logged and built again, the entry replaced);
- a cache that cannot be written (a read-only root, a full disk) is skipped with one
  INFO line: the model loads as without the cache;
- after a hit every tensor the model holds must be one of the entry's, else the entry is
  not used (built again): no parameter is left uninitialised.

Mapped tensors are read-only (PROT_READ): the model never writes to its weights after
loading, and a write would fault rather than change the cache under other processes.
NANOKV_WEIGHT_CACHE=0 switches the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import re
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import nanokv
import nanokv.kernels.build as build

logger = logging.getLogger("nanokv")

_MAGIC = b"NKWEIGHT"
_FORMAT = 1  # the entry file's layout (bumped when it changes)
_PREFIX = struct.Struct("<8sIQ")  # magic, format, header length
_ALIGN = 4096  # every tensor starts on a page
_EDGE_BYTES = 1 << 20  # hashed at each end of a weight file for its identity
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32)}
# the modules whose code decides what the model's tensors hold (their source is in the key)
_SOURCES = ("loader.py", "gguf.py", "weight_cache.py", "kernels/ops.py", "layers", "models")


def enabled() -> bool:
    """NANOKV_WEIGHT_CACHE=0 switches the cache off; anything else (or unset) leaves it on."""
    return os.environ.get("NANOKV_WEIGHT_CACHE", "1") != "0"


def cache_dir() -> Path:
    """The folder of the weight cache: `weights` in nanokv's cache root."""
    return build.cache_root() / "weights"


@dataclass(frozen=True)
class Entry:
    """Where one model's cached weights lie and the stamp the file must carry."""

    path: Path
    stamp: str  # JSON: everything the key is made of


def entry_for(model_dir: str, weight_files: list[str], hf_config, dtype: torch.dtype, device: torch.device,
              tp_size: int, choice) -> Entry | None:
    """The cache entry of this model as it will be loaded, or None where the cache does not
    apply (switched off, not the CPU, tensor parallel: each rank holds a slice)."""
    if not enabled() or device.type != "cpu" or tp_size != 1:
        return None
    try:
        config = hf_config.to_json_string(use_diff=False)
    except (TypeError, ValueError) as e:  # a value json cannot write: no key, no cache
        logger.info("not caching the packed weights: the model config cannot be serialised (%s)", e)
        return None
    stamp = json.dumps({
        "files": [_file_identity(f) for f in weight_files],
        "config": hashlib.sha256(config.encode()).hexdigest(),
        "dtype": str(dtype), "kernels": repr(choice), "torch": torch.__version__, "gguf": _version("gguf"),
        "nanokv": nanokv.__version__, "source": _source_digest(), "format": _FORMAT,
    }, sort_keys=True)
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    base = os.path.basename(os.path.normpath(os.path.realpath(model_dir))).removesuffix(".gguf")
    return Entry(cache_dir() / f"{base}-{key}.weights", stamp)


def _file_identity(path: str) -> list:
    """A weight file's realpath, size, mtime, ctime, inode and a hash of its first and last MiB."""
    import xxhash

    real = os.path.realpath(path)
    st = os.stat(real)
    digest = xxhash.xxh3_128()
    with open(real, "rb") as f:
        digest.update(f.read(_EDGE_BYTES))
        if st.st_size > _EDGE_BYTES:
            f.seek(max(_EDGE_BYTES, st.st_size - _EDGE_BYTES))
            digest.update(f.read(_EDGE_BYTES))
    return [real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest.hexdigest()]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


_source_cache: str | None = None


def _source_digest() -> str:
    """A hash of the source files that load, convert and pack weights (read once per process)."""
    global _source_cache
    if _source_cache is None:
        root = Path(nanokv.__file__).parent
        files = []
        for name in _SOURCES:
            p = root / name
            files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
        digest = hashlib.sha256()
        for p in files:
            for part in (str(p.relative_to(root)).encode(), p.read_bytes()):
                digest.update(len(part).to_bytes(8, "little") + part)
        _source_cache = digest.hexdigest()
    return _source_cache


# ---- what a loaded model holds ---------------------------------------------------------------

@dataclass(frozen=True)
class _Slot:
    """One tensor a loaded model holds: a module's parameter, its packed weight (with the
    PackedWeight's n, k and format) or another tensor attribute (a packed bias)."""

    module: str
    name: str
    kind: str  # "param", "packed" or "attr"
    tensor: torch.Tensor
    owner: object  # the Parameter or PackedWeight (tied weights share one: stored once)


_ATTRS = ("packed_bias",)  # tensor attributes prepare_cpu computes besides the packed weight


def _slots(model: nn.Module) -> list[_Slot]:
    """Every tensor the loaded (and kernel-switched) model reads its weights from."""
    from nanokv.kernels.ops import PackedWeight

    out = []
    for mname, m in model.named_modules():
        for pname, p in m._parameters.items():
            if p is not None:
                out.append(_Slot(mname, pname, "param", p.data, p))
        packed = m.__dict__.get("packed")
        if isinstance(packed, PackedWeight):
            out.append(_Slot(mname, "packed", "packed", packed.data, packed))
        for name in _ATTRS:
            t = m.__dict__.get(name)
            if isinstance(t, torch.Tensor):
                out.append(_Slot(mname, name, "attr", t, t))
    return out


def store(entry: Entry, model: nn.Module) -> None:
    """Write the model's tensors as the entry (skipped, with one INFO line, when the cache
    cannot be written)."""
    import xxhash

    records, chunks, owners, offset = [], [], {}, 0
    digest = xxhash.xxh3_64()
    for s in _slots(model):
        record = {"module": s.module, "name": s.name, "kind": s.kind}
        if s.kind == "packed":
            record.update(n=s.owner.n, k=s.owner.k, format=s.owner.format)
        if id(s.owner) in owners:  # tied: the first holder's bytes
            record["alias"] = owners[id(s.owner)]
            records.append(record)
            continue
        owners[id(s.owner)] = len(records)
        t = s.tensor.detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy()
        pad = -offset % _ALIGN
        if pad:
            chunks.append(bytes(pad))
            digest.update(chunks[-1])
            offset += pad
        record.update(dtype=str(t.dtype), shape=list(t.shape), offset=offset, nbytes=data.nbytes)
        chunks.append(data)
        digest.update(data)
        offset += data.nbytes
        records.append(record)
    header = json.dumps({"stamp": entry.stamp, "data_bytes": offset, "xxh3": digest.hexdigest(),
                         "tensors": records}).encode()
    prefix = _PREFIX.pack(_MAGIC, _FORMAT, len(header)) + header
    prefix += bytes(-len(prefix) % _ALIGN)
    try:
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        _write_whole(entry.path, [prefix, *chunks])
    except OSError as e:
        logger.info("not caching the packed weights in %s: %s (NANOKV_CACHE_DIR sets a writable cache)",
                    entry.path.parent, e)
        return
    logger.info("cached the packed weights: %s (%.0f MiB)", entry.path, (len(prefix) + offset) / 2**20)
    _prune(entry)


KEEP_ENTRIES = 3  # entries kept per model file name (its formats, or versions of nanokv); older ones removed
STALE_TEMP_S = 3600  # a temporary file this old is a crashed writer's


def _prune(entry: Entry) -> None:
    """Remove this model's oldest entries beyond KEEP_ENTRIES (by mtime; the new one stays)
    and crashed writers' temporary files. Only files named as this module names them; a
    process that mapped a removed entry keeps its pages."""
    base = entry.path.name[:-len("-0123456789abcdef.weights")]
    ours = re.compile(re.escape(base) + r"-[0-9a-f]{16}\.weights")
    try:
        found = [(p.stat().st_mtime, p) for p in entry.path.parent.iterdir()]
    except OSError:
        return
    entries = sorted(((t, p) for t, p in found if ours.fullmatch(p.name) and p != entry.path), reverse=True)
    stale = [p for t, p in entries[KEEP_ENTRIES - 1:]]
    now = time.time()
    stale += [p for t, p in found if p.name.startswith(".") and ours.fullmatch(p.name[1:].rsplit("-", 1)[0])
              and now - t > STALE_TEMP_S]
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()
            logger.info("removed the old weight cache entry %s", p)


def _write_whole(path: Path, chunks) -> None:
    """chunks into a temporary file beside path, renamed over it: a reader sees no entry or a
    whole one. Not fsynced (half a gigabyte takes seconds to sync on a slow disk): a crash
    may leave a renamed file whose data never reached the disk, which the checksum refuses."""
    fd, staged = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with open(fd, "wb") as f:
            f.writelines(chunks)
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise


class _Mapped:
    """An entry file's tensors, mapped read-only."""

    def __init__(self, records: list[dict], tensors: dict[int, torch.Tensor]):
        self.records, self.tensors = records, tensors


def _open(entry: Entry) -> _Mapped | None:
    """The entry's tensors if it is whole and is this model's; None (logged, unless there is
    no entry at all) otherwise."""
    import xxhash

    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.info("ignoring the unreadable weight cache entry %s: %s", entry.path, e)
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _PREFIX.size, 0)
        problem = "is truncated"
        if len(head) == _PREFIX.size:
            magic, fmt, header_len = _PREFIX.unpack(head)
            problem = "is not a weight cache entry of this version"
            if magic == _MAGIC and fmt == _FORMAT and _PREFIX.size + header_len <= size:
                problem = None
        if problem is None:
            try:
                header = json.loads(os.pread(fd, header_len, _PREFIX.size))
                data_start = -(-(_PREFIX.size + header_len) // _ALIGN) * _ALIGN
                if header["stamp"] != entry.stamp:
                    problem = "was written for other weights"
                elif size != data_start + header["data_bytes"]:
                    problem = f"has {size} bytes, its header says {data_start + header['data_bytes']}"
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                problem = f"has a damaged header ({e})"
        if problem is None:
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            data = memoryview(mm)[data_start:]
            if xxhash.xxh3_64(data).hexdigest() != header["xxh3"]:
                problem = "does not match its checksum"
            del data
    finally:
        os.close(fd)
    if problem is not None:
        logger.warning("nanokv weight cache: the entry %s %s; building it again", entry.path, problem)
        return None
    try:
        with warnings.catch_warnings():  # a read-only buffer: torch warns that writes would fail, as meant
            warnings.simplefilter("ignore", UserWarning)
            tensors = {}
            for i, r in enumerate(header["tensors"]):
                if "alias" in r:
                    continue
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=r["nbytes"], offset=data_start + r["offset"])
                tensors[i] = raw.view(_DTYPES[r["dtype"]]).view(r["shape"])
        return _Mapped(header["tensors"], tensors)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        logger.warning("nanokv weight cache: the entry %s has a damaged header (%s); building it again",
                       entry.path, e)
        return None


def restore(entry: Entry, model: nn.Module, choice) -> bool:
    """Fill a freshly built model from the entry and switch it to the kernels (choice.apply:
    each layer finds its weight packed and packs nothing). False, the model then unusable,
    when the entry is missing, damaged, or does not give every tensor the model holds."""
    from nanokv.kernels.ops import PackedWeight

    mapped = _open(entry)
    if mapped is None:
        return False
    modules = dict(model.named_modules())
    objects: dict[int, object] = {}
    try:
        for i, r in enumerate(mapped.records):
            m = modules[r["module"]]
            if "alias" in r:
                obj = objects[r["alias"]]
            elif r["kind"] == "param":
                obj = nn.Parameter(mapped.tensors[i], requires_grad=False)
            elif r["kind"] == "packed":
                obj = PackedWeight(mapped.tensors[i], r["n"], r["k"], r["format"])
            else:
                obj = mapped.tensors[i]
            objects[i] = obj
            if r["kind"] == "param":
                m._parameters[r["name"]] = obj
            else:
                setattr(m, r["name"], obj)
    except (KeyError, TypeError) as e:
        logger.warning("nanokv weight cache: the entry %s does not fit the model (%s); building it again",
                       entry.path, e)
        return False
    choice.apply(model)
    held = {(s.module, s.name, s.kind): s.tensor for s in _slots(model)}
    given = {(r["module"], r["name"], r["kind"]): objects[i] for i, r in enumerate(mapped.records)}
    if held.keys() != given.keys() or any(
            held[k].data_ptr() != (o.data if isinstance(o, PackedWeight) else o).data_ptr()
            for k, o in given.items()):
        logger.warning("nanokv weight cache: the entry %s does not give every tensor the model holds; "
                       "building it again", entry.path)
        return False
    return True
