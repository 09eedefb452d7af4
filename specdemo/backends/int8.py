"""int8 copies of draft weights: dynamically quantised linear layers for cheap draft steps on a CPU.

Only drafts and draft heads are quantised here; the target, which decides every token, is never touched (its own
number formats live in :mod:`specdemo.backends.formats`).
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from transformers import PreTrainedModel

from .formats import share_inputs
from .memory import return_free_memory

logger = logging.getLogger(__name__)


#: int8 copies of draft models, keyed weakly by the float model: a copy lives exactly as long as its model
_INT8_COPIES: "weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel]" = weakref.WeakKeyDictionary()


def int8_copy(model: PreTrainedModel) -> PreTrainedModel | None:
    """A float32 CPU copy of ``model`` whose decoder linear layers are int8 (dynamic quantisation), or None.

    On a CPU a one-token step is bound by reading the weights, and PyTorch's bfloat16 matrix-vector product is
    slow there; int8 weights make a draft step several times cheaper. Only drafts are quantised: the target, which
    decides every token, is never touched. The LM head stays in float32 (the drafter restricts it). The copy is
    made once per model and process.
    """
    cached = _INT8_COPIES.get(model)
    if cached is not None:
        return cached
    try:
        import copy

        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError:  # pragma: no cover - a torch without eager-mode quantisation
        logger.warning("int8 draft unavailable in this torch build; drafting in the model's own dtype")
        return None
    clone = copy.deepcopy(model).float().cpu().eval()
    # q, k, v and gate, up: one int8 layer a group, one call (bit-equal: one activation scale of the same input)
    share_inputs(clone, _quantised)
    clone_head = clone.get_output_embeddings()
    spec = {
        name: per_channel_dynamic_qconfig
        for name, module in clone.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not clone_head
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize_dynamic(clone, spec, dtype=torch.qint8, inplace=True)  # no second float copy
    _INT8_COPIES[model] = quantized
    return_free_memory()  # the float32 weights the int8 layers replaced
    return quantized


def is_int8_copy(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an int8 copy made by :func:`int8_copy` (its dynamically quantised layers run on
    FBGEMM's packed weights, which ``torch.compile`` cannot trace)."""
    return any(copy is model for copy in _INT8_COPIES.values())


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """An int8 dynamically quantised linear layer with these float weights."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
        if bias is not None:
            linear.bias.copy_(bias.float())
    return _quantised(linear)


def _quantised(linear: torch.nn.Linear) -> torch.nn.Module:
    """``linear`` (float32) as an int8 dynamically quantised layer."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(torch.nn.Sequential(linear), {"0": per_channel_dynamic_qconfig}, dtype=torch.qint8,
                                inplace=True)  # ``linear`` is always a fresh layer: no copy of its float weights


#: linear layers scoring leading rows of a model's LM head, weakly keyed by the model (freed with it):
#: {(rows, int8): layer}, rows None = the whole head
_HEAD_ROWS: "weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[int | None, bool], torch.nn.Module]]" = (
    weakref.WeakKeyDictionary()
)


def head_rows(model: PreTrainedModel, rows: int | None = None, int8: bool = True) -> torch.nn.Module | None:
    """A linear layer scoring the model's first ``rows`` token ids (None: its whole LM head), int8 or in the head's
    own dtype; made once per model, rows and int8 (quantising 32,768 rows of a draft head takes a third of a
    second, the same for every prompt). None if the head is no Linear."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return None
    layers = _HEAD_ROWS.setdefault(model, {})
    if (rows, int8) not in layers:
        ids = None if rows is None else torch.arange(rows, device=head.weight.device)
        layers[(rows, int8)] = linear_rows(head, ids, int8)
    return layers[(rows, int8)]


def linear_rows(head: torch.nn.Linear, ids: torch.Tensor | None, int8: bool) -> torch.nn.Module:
    """A linear layer scoring only these token ids of ``head`` (None: all), int8 or in the head's dtype."""
    with torch.inference_mode():
        weight = head.weight.detach() if ids is None else head.weight.index_select(0, ids)
        bias = head.bias
        if bias is not None and ids is not None:
            bias = bias.index_select(0, ids)
    if int8:
        return int8_linear(weight, bias)
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer
