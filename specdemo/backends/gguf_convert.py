"""A GGUF file converted straight into the weights a race reads, tensor by tensor, resumably.

Each tensor is dequantised with transformers' own GGUF machinery (``gguf``'s dequantiser and transformers' tensor
processors and name map, as ``from_pretrained(gguf_file=...)`` uses them) and written at once in the stored kind the
race loads (:data:`STORAGES`):

- ``int8``: every linear layer (LM head included; a tied head is the embedding's int8 copy) as int8 values with one
  float32 scale per output row, computed from the bfloat16 weights exactly as :func:`~specdemo.backends.formats.
  int8_rows` does when a bfloat16 model is turned into the ``int8`` or ``w8a8`` format; everything else in bfloat16.
  One kind serves both int8-weight formats bit for bit (:mod:`specdemo.backends.int8_store` builds them);
- ``bfloat16`` and ``float32``: every tensor in that dtype, as a transformers folder ``from_pretrained`` reads.

No float32 copy of a model is kept unless float32 is asked for. The tensors are written in shards (a few decoder
layers each), every shard whole or not at all, into a fixed partial folder beside the final one: a conversion that
is cut off (a kill, a full disk) resumes at its first missing shard, and the final folder appears, with its marker,
only when every shard is there. The caller holds the folder's lock (:mod:`specdemo.backends.offline`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import first_line
from ..core.files import atomic_path, read_json_object, write_json_atomic

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[float, str], None]

INT8_STORAGE, BF16_STORAGE, F32_STORAGE = "int8", "bfloat16", "float32"
#: the stored kinds a GGUF converts into
STORAGES = (INT8_STORAGE, BF16_STORAGE, F32_STORAGE)
#: the version of what a stored folder holds (a folder of another version is converted again)
STORAGE_VERSION = 2
#: decoder layers per shard: the most a cut-off conversion redoes
LAYERS_PER_SHARD = 4
#: the index transformers reads a sharded folder by
INDEX_NAME = "model.safetensors.index.json"
#: what a resumable conversion writes first in its partial folder: what it converts, and into what
PLAN_NAME = "plan.json"
#: the suffix of an int8 linear layer's values and of its scales (one float32 per output row)
QWEIGHT, SCALE = "qweight", "scale"
#: a GGUF tensor of decoder layer N is named ``blk.N.<...>``
_LAYER = re.compile(r"^blk\.(\d+)\.")
#: the ggml types a GGUF stores plain values under (an embedding in one of them is stored in bfloat16)
_PLAIN_GGML_TYPES = ("F32", "F16", "BF16", "F64")


class ConversionError(RuntimeError):
    """A GGUF could not be converted (unsupported, corrupt, or no room on the disk); the message is one line."""


def storage_for(fmt: str) -> str:
    """The stored kind a model in number format ``fmt`` (as --dtype spells it) loads from."""
    if fmt in ("int8", "w8a8"):
        return INT8_STORAGE
    return BF16_STORAGE if fmt == "bfloat16" else F32_STORAGE


# ---------------------------------------------------------------------------------------------------------------
# Reading the GGUF: config, tokenizer and tensors, with transformers' own mapping


@dataclass
class GgufSource:
    """A GGUF file opened for conversion: its reader, the transformers config it describes, and an empty (meta)
    model of that config, which names every tensor and tells which are linear layers."""

    path: Path
    reader: Any
    config: Any
    model: torch.nn.Module
    processor: Any
    name_map: dict[str, str]
    #: tensors already dequantised and kept for the conversion that follows (the first layers a format
    #: measurement read), by GGUF name; each is handed out once
    kept: dict[str, list[tuple[str, Any, Any]]] = field(default_factory=dict)

    def gguf_name_of(self, hf_name: str | None) -> str | None:
        """The GGUF tensor that loads into the transformers parameter ``hf_name``."""
        return next((gguf for gguf, hf in self.name_map.items() if hf == hf_name), None) if hf_name else None

    def layer_of(self, gguf_name: str) -> int | None:
        """The decoder layer a GGUF tensor belongs to, or None (embedding, final norm, head)."""
        match = _LAYER.match(gguf_name)
        return int(match.group(1)) if match else None


def gguf_config(path: Path, config_dict: dict[str, Any] | None = None) -> Any:
    """The transformers config a GGUF file describes, as ``AutoConfig.from_pretrained(gguf_file=...)`` makes it
    (``config_dict``: the metadata transformers' GGUF loader already parsed, so the file is not read twice)."""
    from transformers import AutoConfig

    try:
        if config_dict is None:
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoConfig.for_model(**dict(config_dict))
    except (ValueError, KeyError, OSError, NotImplementedError, RuntimeError) as error:
        raise ConversionError(f"cannot convert {path.name} with transformers: {first_line(error)}") from error


def empty_model(config: Any, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model of ``config`` whose parameters live on the meta device (no memory, no initialisation); buffers such
    as the rotary frequencies are real (accelerate's ``init_empty_weights``)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


#: the GGUF opened last, by (path, size, mtime): measuring a few layers and converting the whole file read its
#: metadata once (parsing a 150k-token vocabulary takes seconds)
_opened: dict[tuple[str, int, int], GgufSource] = {}
_opened_lock = threading.Lock()


def open_gguf(path: Path) -> GgufSource:
    """``path`` opened for conversion (the last file opened is kept: see :func:`forget_opened`)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _opened_lock:
        if key not in _opened:
            _opened.clear()
            _opened[key] = _open_gguf(path)
        return _opened[key]


def forget_opened() -> None:
    """Let go of the GGUF opened last (its memory map keeps a removed file's disk space until then)."""
    with _opened_lock:
        _opened.clear()


def _open_gguf(path: Path) -> GgufSource:
    """Open ``path`` for conversion: its metadata parsed once by transformers' GGUF loader, its tensors mapped."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    try:
        reader = _plain_array_reader(GGUFReader, path)
        with _reader_reused(reader, path):
            parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        config = gguf_config(path, parsed["config"])
        architecture = read_field(reader, "general.architecture")[0]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
        model = empty_model(config)
        name_map = get_gguf_hf_weights_map(model, processor)
    except ConversionError:
        raise
    except (ValueError, KeyError, OSError, NotImplementedError, RuntimeError, IndexError) as error:
        raise ConversionError(f"cannot convert {path.name} with transformers: {first_line(error)}") from error
    return GgufSource(path, reader, config, model, processor, name_map)


_reader_patch = threading.Lock()


class _PlainMemmap:
    """``np.memmap`` as gguf's reader calls it, handing back a plain ndarray view of the same mapping: slicing an
    ``np.memmap`` runs Python code per slice, and the reader slices once per token string (151,936 tokens and as
    many merges: 7.7 s to open the 1.5B target's file, 2.9 s with plain views; the tensors read the same bytes)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> np.ndarray:  # type: ignore[misc]
        return np.memmap(*args, **kwargs).view(np.ndarray)


class _NumpyWithPlainMemmap:
    """The ``numpy`` module as gguf's reader module sees it while :func:`_plain_array_reader` runs."""

    def __getattr__(self, name: str) -> Any:
        return _PlainMemmap if name == "memmap" else getattr(np, name)


def _plain_array_reader(reader_class: Any, path: Path) -> Any:
    """gguf's own reader over ``path``, its arrays plain views of the file's mapping (see :class:`_PlainMemmap`)."""
    import gguf.gguf_reader as reader_module

    with _reader_patch:
        original = reader_module.np
        reader_module.np = _NumpyWithPlainMemmap()
        try:
            return reader_class(str(path))
        finally:
            reader_module.np = original


@contextlib.contextmanager
def _reader_reused(reader: Any, path: Path) -> Iterator[None]:
    """Inside, transformers' GGUF loader reads ``path``'s metadata from ``reader`` instead of parsing the file
    again (gguf-py's reader spends seconds on a 150k-token vocabulary: once per file is enough)."""
    import gguf

    with _reader_patch:
        original = gguf.GGUFReader

        def reader_for(file: Any, *args: Any, **kwargs: Any) -> Any:
            same = Path(str(file)).resolve() == path.resolve() and not args and not kwargs
            return reader if same else original(file, *args, **kwargs)

        gguf.GGUFReader = reader_for
        try:
            yield
        finally:
            gguf.GGUFReader = original


def iter_tensors(source: GgufSource, gguf_names: Sequence[str], keep: bool = False,
                 blocks_of: str | None = None) -> Iterator[tuple[str, torch.Tensor | None, Any]]:
    """``(transformers name, float32 tensor, raw)`` for the GGUF tensors named, dequantised and processed exactly
    as transformers' GGUF loader does (tensors it would not load are skipped); ``raw`` is the file's tensor when
    the processing leaves its values as dequantised (None when it changes them). The tensor ``blocks_of`` (a GGUF
    name) is not dequantised when it can be kept in its blocks: its float tensor is then None. With ``keep`` the
    results are also kept for the next call (see :attr:`GgufSource.kept`)."""
    by_name = {tensor.name: tensor for tensor in source.reader.tensors}
    for gguf_name in gguf_names:
        kept = source.kept.pop(gguf_name, None)
        if kept is not None:
            yield from kept
            continue
        tensor = by_name[gguf_name]
        if gguf_name == blocks_of and keeps_blocks(source, tensor):
            yield source.name_map[gguf_name], None, tensor
            continue
        results = list(_dequantized(source, tensor))
        if keep:
            source.kept[gguf_name] = results
        yield from results


def keeps_blocks(source: GgufSource, tensor: Any) -> bool:
    """Whether ``tensor`` can stay in its GGUF blocks: quantised, loaded under its own name, and left as dequantised
    by transformers' processor (which decides by name alone: given the blocks, it hands back the same array)."""
    if tensor.tensor_type.name in _PLAIN_GGML_TYPES or tensor.name not in source.name_map:
        return False
    result = source.processor.process(weights=tensor.data, name=tensor.name, tensor_key_mapping=source.name_map,
                                      parsed_parameters={"tensors": {}})
    return result.weights is tensor.data and result.name == tensor.name


def _dequantized(source: GgufSource, tensor: Any) -> Iterator[tuple[str, torch.Tensor, Any]]:
    from gguf import dequantize

    parsed: dict[str, Any] = {"tensors": {}}
    weights = dequantize(tensor.data, tensor.tensor_type)
    result = source.processor.process(weights=weights, name=tensor.name, tensor_key_mapping=source.name_map,
                                      parsed_parameters=parsed)
    for hf_name, extra in parsed["tensors"].items():  # processors that split a tensor (experts) put them here
        yield hf_name, torch.as_tensor(extra).float(), None
    if result.weights is None or result.name not in source.name_map:
        return
    unchanged = result.weights is weights and result.name == tensor.name
    yield source.name_map[result.name], torch.from_numpy(np.copy(result.weights)), tensor if unchanged else None


# ---------------------------------------------------------------------------------------------------------------
# What each tensor becomes


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The linear layers (GPT-2's ``Conv1D`` too) of ``model`` by name: those an int8 format makes int8."""
    from transformers.pytorch_utils import Conv1D

    return {name: module for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}


#: rows quantised at a time: each row is quantised alone, so blocks give the same bits as the whole matrix, and a
#: block's float32 temporaries stay small (a 151,936-row head: 1.9 s whole, 1.3 s in blocks)
ROWS_AT_A_TIME = 4096


def int8_rows_of_bf16(weight: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values and float32 row scales the int8-weight formats give a weight loaded in bfloat16."""
    from .formats import int8_rows

    weight = weight.to(torch.bfloat16)
    if transposed:  # Conv1D keeps its weight as [in, out]
        weight = weight.t().contiguous()
    qweight = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], ROWS_AT_A_TIME):
        stop = start + ROWS_AT_A_TIME
        qweight[start:stop], scale[start:stop] = int8_rows(weight[start:stop].float())
    return qweight, scale


@dataclass(frozen=True)
class _Layout:
    """How a model's tensors are stored: which parameter names are linear weights, and the tied head, if any."""

    linear_weights: dict[str, bool]  # weight name -> stored transposed (Conv1D)
    tied_head: str | None  # the head's weight name when it is the embedding (then made from the embedding)
    embedding: str | None


def _layout(model: torch.nn.Module, config: Any) -> _Layout:
    from transformers.pytorch_utils import Conv1D

    linear = {f"{name}.weight": isinstance(module, Conv1D) for name, module in linear_layers(model).items()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    head_name = names.get(id(head)) if head is not None else None
    tied = bool(getattr(config, "tie_word_embeddings", False)) and head is not None
    return _Layout(linear, f"{head_name}.weight" if tied and head_name else None,
                   f"{names[id(embed)]}.weight" if embed is not None and id(embed) in names else None)


#: the suffixes of an embedding kept in its GGUF blocks: the blocks, and their ggml type
GGUF_BLOCKS, GGUF_TYPE = "gguf_blocks", "gguf_type"


def stored_tensors(name: str, tensor: torch.Tensor | None, storage: str, layout: _Layout,
                   raw: Any = None) -> dict[str, torch.Tensor]:
    """What one loaded tensor (float32, as transformers' GGUF loader gives it; ``raw``: the file's own tensor when
    its values are the dequantised blocks; ``tensor`` None: only the blocks were read) is stored as."""
    if storage == F32_STORAGE:
        return {name: tensor.float().contiguous()}
    if storage == BF16_STORAGE:
        return {name: tensor.to(torch.bfloat16).contiguous()}
    out: dict[str, torch.Tensor] = {}
    targets = [name] + ([layout.tied_head] if name == layout.embedding and layout.tied_head else [])
    for target in targets:
        if tensor is None or (target == layout.embedding and raw is not None
                              and raw.tensor_type.name not in _PLAIN_GGML_TYPES):
            prefix = target.removesuffix(".weight")  # looked up a row at a time: kept as the file's blocks
            out[f"{prefix}.{GGUF_BLOCKS}"] = torch.from_numpy(np.array(raw.data, dtype=np.uint8))
            out[f"{prefix}.{GGUF_TYPE}"] = torch.tensor(int(raw.tensor_type))
        elif target in layout.linear_weights:
            qweight, scale = int8_rows_of_bf16(tensor, transposed=layout.linear_weights[target])
            prefix = target.removesuffix(".weight")
            out[f"{prefix}.{QWEIGHT}"], out[f"{prefix}.{SCALE}"] = qweight, scale
        else:
            out[target] = tensor.to(torch.bfloat16).contiguous()
    return out


def _stored_bytes(shape: Sequence[int], name: str, storage: str, layout: _Layout) -> int:
    count = int(np.prod(shape)) if len(shape) else 1
    if storage == F32_STORAGE:
        return 4 * count
    if storage == BF16_STORAGE:
        return 2 * count
    total = count if name in layout.linear_weights else 2 * count
    if name == layout.embedding and layout.tied_head:
        total += count
    return total


# ---------------------------------------------------------------------------------------------------------------
# Converting, in shards


@dataclass(frozen=True)
class Shard:
    """One file of a conversion: its name and the GGUF tensors it holds."""

    file: str
    gguf_names: tuple[str, ...]


def plan_shards(source: GgufSource) -> list[Shard]:
    """The conversion's shards: every :data:`LAYERS_PER_SHARD` decoder layers, then the rest (embedding, final
    norm, head), in file order."""
    groups: dict[int, list[str]] = {}
    rest: list[str] = []
    for tensor in source.reader.tensors:
        layer = source.layer_of(tensor.name)
        if layer is None:
            rest.append(tensor.name)
        else:
            groups.setdefault(layer // LAYERS_PER_SHARD, []).append(tensor.name)
    named = [names for _, names in sorted(groups.items())] + ([rest] if rest else [])
    return [Shard(f"model-{i + 1:05d}-of-{len(named):05d}.safetensors", tuple(names)) for i, names in enumerate(named)]


def convert(
    gguf: Path,
    out_dir: Path,
    storage: str,
    identity: dict[str, Any],
    finish: Callable[[GgufSource, Path], None],
    on_progress: ProgressCallback | None = None,
) -> None:
    """Convert ``gguf`` into ``out_dir`` (a partial folder: shards already there from a cut-off conversion of the
    same ``identity`` and ``storage`` are kept), then let ``finish`` add the config, tokenizer and marker."""
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}: use one of {', '.join(STORAGES)}")
    source = open_gguf(gguf)
    layout = _layout(source.model, source.config)
    shards = plan_shards(source)
    plan = {"identity": identity, "storage": storage, "version": STORAGE_VERSION,
            "shards": [[shard.file, list(shard.gguf_names)] for shard in shards]}
    done = _resume(out_dir, plan)
    blocks_of = source.gguf_name_of(layout.embedding) if storage == INT8_STORAGE and not layout.tied_head else None
    _check_space(out_dir, source, shards, done, storage, layout, blocks_of)
    weight_map: dict[str, str] = {}
    total = len(shards)
    for index, shard in enumerate(shards):
        _report(on_progress, index / total, f"Converting {gguf.name} into {storage}: shard {index + 1} of {total}")
        path = out_dir / shard.file
        if shard.file in done:
            weight_map.update(dict.fromkeys(_safetensors_keys(path), shard.file))
            continue
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor, raw in iter_tensors(source, shard.gguf_names, blocks_of=blocks_of):
            tensors.update(stored_tensors(name, tensor, storage, layout, raw))
        _write_shard(path, tensors, out_dir)
        weight_map.update(dict.fromkeys(tensors, shard.file))
    total_size = sum((out_dir / shard.file).stat().st_size for shard in shards)
    write_json_atomic(out_dir / INDEX_NAME, {"metadata": {"total_size": total_size, "storage": storage},
                                             "weight_map": dict(sorted(weight_map.items()))})
    finish(source, out_dir)
    (out_dir / PLAN_NAME).unlink(missing_ok=True)
    _report(on_progress, 1.0, f"Converted {gguf.name} into {storage}")


def _resume(out_dir: Path, plan: dict[str, Any]) -> set[str]:
    """The shards of ``plan`` already written in ``out_dir``; anything else there (another plan's files, a
    partial write) is removed first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recorded = read_json_object(out_dir / PLAN_NAME)
    if recorded != plan:
        for item in out_dir.iterdir():
            shutil.rmtree(item) if item.is_dir() else item.unlink()
        write_json_atomic(out_dir / PLAN_NAME, plan)
        return set()
    expected = {file for file, _ in plan["shards"]}
    done = set()
    for item in out_dir.iterdir():
        if item.name in expected and _safetensors_keys(item) is not None:
            done.add(item.name)
        elif item.name != PLAN_NAME:
            item.unlink() if item.is_file() else shutil.rmtree(item)
    if done:
        logger.info("Resuming a cut-off conversion in %s: %d of %d shards already written", out_dir, len(done),
                    len(expected))
    return done


def _safetensors_keys(path: Path) -> list[str] | None:
    """The tensor names of a whole safetensors file, None when it cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except (OSError, ValueError, RuntimeError):
        return None


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    from safetensors.torch import save_file

    try:
        with atomic_path(path) as partial:
            save_file(tensors, str(partial), metadata={"format": "pt"})
    except OSError as error:
        if error.errno == errno.ENOSPC:
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            raise ConversionError(f"the disk is full: {out_dir.parent} needs about {need / 1e9:.1f} GB more for "
                                  f"{path.name}; free some space (or set SPECDEMO_CACHE elsewhere)") from None
        raise


#: room kept free beyond a conversion's own bytes (the config, tokenizer and filesystem slack)
SPACE_MARGIN_BYTES = 64 * 1024 * 1024


def _check_space(out_dir: Path, source: GgufSource, shards: list[Shard], done: set[str], storage: str,
                 layout: _Layout, blocks_of: str | None) -> None:
    """Refuse, in one line naming the folder, a conversion whose remaining shards cannot fit on the disk."""
    tensors = {tensor.name: tensor for tensor in source.reader.tensors}

    def stored(name: str) -> int:
        if name == blocks_of:
            return int(tensors[name].n_bytes)
        shape = list(reversed([int(d) for d in tensors[name].shape]))
        return _stored_bytes(shape, source.name_map.get(name, name), storage, layout)

    need = sum(stored(name) for shard in shards if shard.file not in done for name in shard.gguf_names)
    free = shutil.disk_usage(out_dir).free
    if need + SPACE_MARGIN_BYTES > free:
        raise ConversionError(f"not enough disk space in {out_dir.parent}: converting {source.path.name} into "
                              f"{storage} needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free; free some space "
                              "(or set SPECDEMO_CACHE elsewhere)")


def _report(on_progress: ProgressCallback | None, fraction: float, message: str) -> None:
    logger.info("%s", message)
    if on_progress is not None:
        on_progress(fraction, message)


# ---------------------------------------------------------------------------------------------------------------
# A few layers of the real weights, for measuring formats before any conversion


def load_first_layers(gguf: Path, layers: int) -> tuple[torch.nn.Module, int]:
    """The GGUF's model cut to its first ``layers`` decoder layers (embedding, final norm and head kept), in
    bfloat16 as a full load would give them, and how many layers the whole model has. Only those tensors are
    dequantised."""
    source = open_gguf(gguf)
    total = int(source.config.num_hidden_layers)
    config = source.config.__class__.from_dict(source.config.to_dict())
    config.num_hidden_layers = min(layers, total)
    if hasattr(config, "layer_types") and isinstance(config.layer_types, list):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    model = empty_model(config)
    wanted = [tensor.name for tensor in source.reader.tensors
              if (layer := source.layer_of(tensor.name)) is None or layer < config.num_hidden_layers]
    layout = _layout(model, config)
    blocks_of = None if layout.tied_head else source.gguf_name_of(layout.embedding)
    state = {}
    for name, tensor, raw in iter_tensors(source, wanted, keep=True, blocks_of=blocks_of):
        if tensor is None:  # the embedding, looked up from its blocks as the int8 storage keeps it
            from .gguf_embedding import GgufRowsEmbedding

            blocks = torch.from_numpy(np.array(raw.data, dtype=np.uint8))
            embedding = model.get_input_embeddings()
            model.set_input_embeddings(GgufRowsEmbedding(blocks, int(raw.tensor_type), embedding.embedding_dim,
                                                         torch.bfloat16, embedding.padding_idx))
        else:
            state[name] = tensor.to(torch.bfloat16)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise ConversionError(f"cannot measure {gguf.name}: it lacks {', '.join(missing[:3])}")
    return model.eval(), total
