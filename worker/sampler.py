"""Vectorized sampling over a batch of logit rows, each with its own controls.

Before sampling, optional per-row controls change the logits (vLLM's order and semantics): the logit bias is added,
tokens a row may not emit yet (EOS and stop ids before min_tokens) become -inf, then repetition / frequency /
presence penalties apply. Greedy rows take the argmax of the changed logits.

Sampling is an exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` draws from ``probs`` exactly, and
excluded tokens (probability 0) can never win. Rows with a seed draw their noise from a counter-based hash of
(seed, position, token id), so a seeded request gets the same tokens whatever else shares its batch.

On CUDA, batches without top-k / top-p / min-p / seeds (the common case) take ``kernels.sampling``: the same law
(Gumbel-max on ``logits / T``) in one read of the model-dtype logits instead of ~7 float32 passes.

Under tensor parallelism such batches (and all-greedy ones anywhere) are sampled on the vocabulary shards
(``shard_candidates``, then ``pick_across_shards``): every rank proposes its shard's best (score, token id) per
row and all ranks pick the same winner, so the logits are never gathered and no token broadcast is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import sample_argmax, shard_best

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingTensors:
    """Per-row controls on the device; ``all_greedy``/``any_*`` are host-side facts that let us skip work."""

    # per-row controls the chosen path does not read are None: all of them when all_greedy (an argmax), all but
    # temperature on the fused CUDA kernel (see uses_fused_kernel)
    temperature: torch.Tensor | None  # [n] float32, 0 = greedy
    top_k: torch.Tensor | None  # [n] int64, <= 0 disables
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    seed: torch.Tensor | None  # [n] int64, -1 = unseeded
    position: torch.Tensor | None  # [n] int64, the sampled token's position (the seeded noise counter)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_seed: bool
    # optional controls; None = no row uses them (the common case costs nothing)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, token id, float32 bias)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, token id) pairs forced to -inf
    penalty_rows: torch.Tensor | None = None  # [r] int64 rows with a penalty; the fields below follow them
    presence_penalty: torch.Tensor | None = None  # [r] float32
    frequency_penalty: torch.Tensor | None = None  # [r] float32
    repetition_penalty: torch.Tensor | None = None  # [r] float32
    output_counts: torch.Tensor | None = None  # [r, vocab] int32: occurrences of each token in the output so far
    prompt_mask: torch.Tensor | None = None  # [r, vocab] bool: tokens of the prompt (repetition penalty only)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # structured outputs: (rows, int32 bitmasks [r, words])
    processed: tuple | None = None  # (processor, its prepared data) of worker/logits_processors.py's in use


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) carried in int64 lanes; masking keeps it exact despite wraparound."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [n, vocab], a pure function of (seed, position, token id)."""
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    # fold the seed's high 32 bits in (a no-op for seeds < 2**32), so seeds equal in their low bits differ
    row = _hash32(_hash32(seed ^ _hash32(seed >> 32)) ^ _hash32(position * 0x9E3779B1 + 0x632BE5AB))
    bits = _hash32(row[:, None] ^ (token[None, :] * 0x85EBCA77 + 0x27D4EB2F))
    # the top 128 of 2**32 values round to 1.0 in float32; noise 1.0 gives an excluded token 0/-0 = NaN,
    # which wins argmax, so keep it strictly below 1
    return (bits.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32).clamp_(max=1.0 - 2.0**-24)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on float32 logits [r, vocab] (a new tensor): a token seen in the prompt or the output has
    its logit divided by the repetition penalty when positive, multiplied by it otherwise; then the output
    counts subtract ``frequency * count`` and ``presence * (count > 0)`` (OpenAI's definition)."""
    seen_out = output_counts > 0
    rep = torch.where(prompt_mask | seen_out, repetition.unsqueeze(1), 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / rep, rep)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * seen_out


def has_controls(st: SamplingTensors) -> bool:
    """Whether some row's logits change before sampling (logit bias, min_tokens masks, penalties, logits
    processors, token masks)."""
    return (
        st.logit_bias is not None
        or st.banned is not None
        or st.penalty_rows is not None
        or st.processed is not None
        or st.allowed is not None
    )


def allowed_tokens(bitmasks: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmasks [r, words] (token i: bit i % 32 of word i // 32) as bool [r, vocab]. Read as little-endian
    bytes (token i: bit i % 8 of byte i // 8), so the unpacked intermediate is a byte a token, not 4."""
    bits = torch.arange(8, dtype=torch.uint8, device=bitmasks.device)
    return ((bitmasks.view(torch.uint8).unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()


def apply_controls(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logit bias, then min_tokens masks, then penalties, then logits processors, then structured outputs' token
    masks, on float32 logits; returns ``logits`` itself when no row uses them."""
    if not has_controls(st):
        return logits
    logits = logits.clone()
    if st.logit_bias is not None:  # every biased (row, token) of the step in one kernel
        rows, tokens, bias = st.logit_bias
        logits.index_put_((rows, tokens), bias, accumulate=True)
    if st.banned is not None:
        # a -inf filled on the device: torch.tensor(..., device=cuda) is a blocking copy that waits for the stream
        logits.index_put_(st.banned, logits.new_full((), -torch.inf))
    if st.penalty_rows is not None:
        rows = st.penalty_rows
        logits[rows] = apply_penalties(
            logits[rows],
            st.output_counts,
            st.prompt_mask,
            st.presence_penalty,
            st.frequency_penalty,
            st.repetition_penalty,
        )
    for proc, prepared in st.processed or ():
        logits = proc.apply(logits, prepared)
    if st.allowed is not None:
        rows, bitmasks = st.allowed
        logits[rows] = logits[rows].masked_fill(~allowed_tokens(bitmasks, logits.shape[1]), -torch.inf)
    return logits


def apply_filters(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as -inf masks. ``logits`` is float32 [n, vocab]."""
    logits = logits / st.temperature.clamp(min=1e-6).unsqueeze(1)
    if st.any_top_k or st.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if st.any_top_k:
            k = torch.where(st.top_k > 0, st.top_k, logits.shape[1])
            drop |= rank[None, :] >= k[:, None]
        if st.any_top_p:
            probs = sorted_logits.masked_fill(drop, -torch.inf).softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # the top token always survives
            drop |= mass_before >= st.top_p[:, None]
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), -torch.inf)
    if st.any_min_p:
        probs = logits.softmax(-1)
        threshold = st.min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, -torch.inf)
    return logits


def uses_fused_kernel(on_cuda: bool, any_top_k: bool, any_top_p: bool, any_min_p: bool, any_seed: bool) -> bool:
    """Whether ``sample`` takes the fused CUDA kernel, which reads only ``temperature`` of the per-row controls."""
    return on_cuda and not (any_top_k or any_top_p or any_min_p or any_seed)


def sample(
    logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None = None, noise_seed: int = 0
) -> torch.Tensor:
    """One token id per row (int64 [n]). ``noise_seed`` keys the fused CUDA path's noise (new one per step)."""
    if uses_fused_kernel(logits.is_cuda, st.any_top_k, st.any_top_p, st.any_min_p, st.any_seed):
        if has_controls(st):
            logits = apply_controls(logits.float(), st)
        return sample_argmax(logits, None if st.all_greedy else st.temperature, noise_seed)
    logits = apply_controls(logits.float(), st)
    greedy = logits.argmax(-1)
    if st.all_greedy:
        return greedy
    probs = apply_filters(logits, st).softmax(-1)
    noise = torch.rand(probs.shape, device=probs.device, generator=generator)
    if st.any_seed:
        seeded = st.seed >= 0
        noise = torch.where(seeded[:, None], seeded_uniform(st.seed, st.position, probs.shape[1]), noise)
    sampled = (probs / -noise.clamp_(min=1e-20).log()).argmax(-1)
    return torch.where(st.temperature == 0, greedy, sampled)


def samples_on_shards(on_cuda: bool, st: SamplingTensors) -> bool:
    """Whether a batch can be sampled on the vocabulary shards: no per-row bias, masks or penalties (the caller
    checks logprobs), and either all greedy or, on CUDA, the fused kernel's temperature-only sampling."""
    if has_controls(st):
        return False
    return st.all_greedy or uses_fused_kernel(on_cuda, st.any_top_k, st.any_top_p, st.any_min_p, st.any_seed)


def shard_candidates(
    logits: torch.Tensor, st: SamplingTensors, noise_seed: int, col_offset: int, vocab: int
) -> torch.Tensor:
    """This shard's best per row as float64 [n, 2]: (score, global token id). ``logits`` holds the shard's valid
    columns, token ids ``col_offset ..`` of a ``vocab``-token vocabulary; the noise depends on the global id
    only, so the whole vocabulary's winner is the best of the shards' (``pick_across_shards``)."""
    if logits.is_cuda:
        scores, ids = shard_best(logits, None if st.all_greedy else st.temperature, noise_seed, col_offset, vocab)
    else:  # all greedy (samples_on_shards): the first maximal column, as argmax
        scores, ids = logits.float().max(-1)
        ids = ids + col_offset
    return torch.stack([scores.double(), ids.double()], -1)  # ids < 2**53: exact in float64


def pick_across_shards(candidates: torch.Tensor) -> torch.Tensor:
    """Token ids (int64 [n]) from every shard's candidates [tp, n, 2], in rank order: the highest score, and on a
    tie the lowest rank, which holds the lowest token id (the unsharded argmax's choice)."""
    best_rank = candidates[..., 0].argmax(0)  # the first maximal: the lowest rank
    return candidates[..., 1].gather(0, best_rank[None])[0].long()
