"""What a step takes as request input: the errors for bad input, integer vectors checked on the
host, and token ids that stay on the device (`DeviceTokens`)."""

from __future__ import annotations

import numpy as np
import torch


class InputError(ValueError):
    """Bad request input (out-of-vocabulary id, empty prompt, too long, malformed batch)."""


def _host_long(a, what: str = "argument") -> np.ndarray:
    """A 1-D int64 numpy vector (host metadata) from a 1-D integer list / tensor (one copy if the
    tensor lives on a device). Floats and other shapes are refused, not rounded or flattened."""
    if isinstance(a, torch.Tensor):
        t = a
    else:
        try:
            t = torch.as_tensor(a)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InputError(f"{what} must be a 1-D integer tensor or list of ints; got {type(a).__name__} that "
                             f"torch cannot read as one ({str(e).splitlines()[0][:120]})") from None
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise InputError(f"{what} must hold integers; got dtype {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != 1 and not (t.numel() == 0 and t.dim() <= 1):
        raise InputError(f"{what} must be 1-D (flattened tokens); got shape {tuple(t.shape)}")
    if t.dtype != torch.int64 or t.device.type != "cpu":
        t = t.to("cpu", torch.int64)
    return t.reshape(-1).numpy()      # integer tensors carry no gradient: no detach needed


def _is_int(x) -> bool:
    """A Python / numpy integer; a bool is not a token id."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def token_ids(p, what: str) -> list[int]:
    """One prompt's token ids as a list of ints: a sequence of ints or a 1-D integer tensor /
    array. Floats, bools, strings and nested sequences are refused, never converted."""
    if isinstance(p, (torch.Tensor, np.ndarray)):
        kind = p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool \
            if isinstance(p, torch.Tensor) else p.dtype.kind not in "iu"
        if kind or p.ndim != 1:
            raise InputError(f"{what}: expected a 1-D integer tensor of token ids; got {p.dtype} of shape "
                             f"{tuple(p.shape)}")
        return [int(x) for x in p.tolist()]
    if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
        raise InputError(f"{what}: expected a sequence of token ids (ints); got {type(p).__name__}")
    out = list(p)
    for j, x in enumerate(out):
        if not _is_int(x):
            raise InputError(f"{what}: token {j} is {x!r} ({type(x).__name__}); token ids must be ints "
                             f"(floats, bools and strings are not converted)")
    return [int(x) for x in out]


def eos_ids(v) -> frozenset[int]:
    """`eos_token_id` of `generate`: None (no stop token), an int, or a list of ints."""
    if v is None:
        return frozenset()
    if _is_int(v):
        return frozenset((int(v),))
    if isinstance(v, (list, tuple, set, frozenset)) and all(_is_int(x) for x in v):
        return frozenset(int(x) for x in v)
    raise InputError(f"generate: eos_token_id must be None, an int or a list of ints; got {v!r}")


class DeviceTokens:
    """Token ids that stay on the model's device, made by `model.greedy_tokens(logits)` (the argmax
    of each logits row) or `forward_batch(sample=...)` (an argmax over noisy logits) only, so every
    id is in [0, vocab) by construction; their values are not checked again. `forward_batch` takes
    them as `input_ids` without reading them back: the host never waits for the step that produced
    them, so the next step is queued while that one still runs (an engine's async decode).
    `tolist()` reads them (that waits)."""

    __slots__ = ("tensor", "vocab")

    def __init__(self, tensor: torch.Tensor, vocab: int) -> None:
        self.tensor, self.vocab = tensor, vocab

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def tolist(self) -> list[int]:
        return self.tensor.tolist()

    def __repr__(self) -> str:
        return f"DeviceTokens({len(self)} ids on {self.tensor.device})"


def checked_prompts(prompts, max_new_tokens, config, encode) -> list[list[int]]:
    """`generate`'s prompts as token-id lists (`encode(p, i)` for each), checked: a list of prompts
    (not one str, not a flat list of ints), none empty, ids in the vocabulary, and each with
    max_new_tokens within max_position_embeddings; InputError naming the prompt otherwise."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if isinstance(prompts, str):
        raise InputError("generate: prompts must be a list (of str or of token-id lists); got one str")
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"generate: prompts must be a list (of str or of token-id lists); got "
                         f"{type(prompts).__name__}")
    if prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
        raise InputError(f"generate: prompts must be a list of prompts; got a flat list of {len(prompts)} ints "
                         f"(one prompt is written [[1, 2, 3]], not [1, 2, 3])")
    prompts = [encode(p, i) for i, p in enumerate(prompts)]
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    V, maxpos = config.vocab_size, config.max_position_embeddings
    for i, p in enumerate(prompts):
        if not p:
            raise InputError(f"prompt {i} is empty")
        bad = [t for t in p if t < 0 or t >= V]
        if bad:
            raise InputError(f"prompt {i}: token ids out of vocabulary [0, {V}): {bad[:5]}")
        if len(p) + max_new_tokens > maxpos:
            raise InputError(f"prompt {i}: {len(p)} prompt + {max_new_tokens} new tokens exceeds "
                             f"max_position_embeddings={maxpos}")
    return prompts


def checked_rows(rows, name: str, T: int):
    """None, or ``rows`` (``logits_rows`` / ``hidden_rows`` of a step of T tokens) as a host int64
    vector, each in [-T, T); else InputError naming the argument."""
    if rows is None:
        return None
    out = _host_long(rows, name)
    if out.size and (int(out.min()) < -T or int(out.max()) >= T):
        raise InputError(f"{name} must index the {T} flattened tokens; got {out.tolist()[:8]}")
    return out
