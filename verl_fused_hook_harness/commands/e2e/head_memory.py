"""The output layer's own extra memory inside a real training step with MTP (main head plus MTP heads).

Why: a step's peak mixes the decoder's activations with the output layer's
cost; the MTP issue's target is about the latter alone. Everything after the
MTP block runs from one call on: `process_mtp_loss` (megatron's, which verl's
MTP patch calls, or hook mode's fused replacement), then the main head (verl's
logits, or the output_processor hook), the loss, and in backward the heads'
gradients, which end in the gradient of the hidden states that call received.
`HeadMemoryProbe` wraps both names a step may call for the duration of one
step, and on CUDA measures from that call (peak statistics reset, memory
allocated = base) to the moment autograd has the hidden states' gradient (a
tensor hook): extra = peak - base - what the heads must hand back (that
gradient and the output weight's gradient, measured from the tensors). The
interval also holds megatron's `torch.chunk` of the concatenated main and MTP
hidden states: its backward holds every head's hidden gradient while it
concatenates them into the returned one, one more buffer of that size, which
is reported beside `extra` (`split_backward_bytes`) so the output layer's own
part can be read without it. On the CPU the memory figures are None; the
call, the gradients and their sizes are still recorded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

# where a step finds process_mtp_loss: megatron's own _postprocess (hook mode: the plugin's replacement)
# and verl's MTP _postprocess patch (verl as it ships)
_CALL_SITES = (
    ("megatron.core.models.gpt.gpt_model", "process_mtp_loss"),
    ("verl.models.mcore.mtp_patch", "_process_mtp_loss"),
)


def _defined_as(fn) -> str:
    """Where fn's code was written (functools.wraps copies names, not code): module.qualname."""
    return f"{fn.__globals__['__name__']}.{fn.__code__.co_qualname}"


class HeadMemoryProbe(contextlib.AbstractContextManager):
    """Measure one step's output layer (see the module doc); read `result()` after the step's backward."""

    def __init__(self, output_weight: torch.Tensor):
        self.output_weight = output_weight
        self.calls: list[str] = []
        self.hidden_rows: int | None = None
        self.hidden_grad_bytes: int | None = None
        self.base_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self):
        for module_name, attribute in _CALL_SITES:
            module = importlib.import_module(module_name)
            original = getattr(module, attribute)
            self._saved.append((module, attribute, original))
            setattr(module, attribute, self._wrap(original))
        return self

    def __exit__(self, *exc):
        for module, attribute, original in reversed(self._saved):
            setattr(module, attribute, original)
        self._saved.clear()
        return False

    def _wrap(self, original):
        @functools.wraps(original)
        def measured(*args, **kwargs):
            hidden = kwargs["hidden_states"]  # megatron and verl both call it with keywords
            self.calls.append(_defined_as(original))
            self.hidden_rows = hidden.shape[0] * hidden.shape[1]
            if hidden.is_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.base_bytes = torch.cuda.memory_allocated()
            if hidden.requires_grad:
                hidden.register_hook(self._on_hidden_grad)
            return original(*args, **kwargs)

        return measured

    def _on_hidden_grad(self, grad: torch.Tensor) -> None:
        self.hidden_grad_bytes = grad.numel() * grad.element_size()
        if grad.is_cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()

    def result(self, scored_rows: dict[str, int]) -> dict:
        """The measurement, with the op's fp32 hidden-gradient accumulator for the largest op call
        (4 bytes x H x scored rows; the heads' backward calls run one after another) and the target."""
        weight = self.output_weight
        weight_grad_bytes = weight.grad.numel() * weight.grad.element_size() if weight.grad is not None else None
        hidden_size = weight.shape[-1]
        accumulator = 4 * hidden_size * max(scored_rows.values())
        out = {
            "calls": list(self.calls),
            "hidden_rows": self.hidden_rows,
            "scored_rows": dict(scored_rows),
            "hidden_grad_bytes": self.hidden_grad_bytes,
            "weight_grad_bytes": weight_grad_bytes,
            "accumulator_bytes": accumulator,
            "target_bytes": int(1.5 * 2**30) + accumulator,
            "base_bytes": self.base_bytes,
            "peak_bytes": self.peak_bytes,
            "split_backward_bytes": self.hidden_grad_bytes,
            "extra_bytes": None,
            "within_target": None,
            "extra_without_split_bytes": None,
            "within_target_without_split": None,
        }
        if None not in (self.peak_bytes, self.base_bytes, self.hidden_grad_bytes, weight_grad_bytes):
            out["extra_bytes"] = self.peak_bytes - self.base_bytes - self.hidden_grad_bytes - weight_grad_bytes
            out["within_target"] = out["extra_bytes"] <= out["target_bytes"]
            out["extra_without_split_bytes"] = out["extra_bytes"] - self.hidden_grad_bytes
            out["within_target_without_split"] = out["extra_without_split_bytes"] <= out["target_bytes"]
        return out
