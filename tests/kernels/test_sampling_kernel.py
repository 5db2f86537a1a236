"""The fused sampling kernel (kernels/sampling.py): greedy rows equal torch's argmax exactly (ties included),
sampled rows follow softmax(logits / T). On CUDA at real vocabulary sizes, on the CPU under TRITON_INTERPRET=1."""

import pytest
import torch

from kernels import sampling

ON_GPU = torch.cuda.is_available()  # without CUDA, conftest.py runs the kernels in the Triton interpreter
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
VOCAB = 151_936 if ON_GPU else 5_000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_greedy_equals_torch_argmax_on_padded_rows(dtype, rows):
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    padded = torch.randn(rows, VOCAB + 64, device=DEVICE, generator=g).to(dtype)
    logits = padded[:, :VOCAB]  # strided rows, as the LM head's padded vocabulary gives them
    logits[0, VOCAB - 1] = 50.0  # the maximum in the very last column
    if rows > 1:
        logits[1, 7] = logits[1, VOCAB // 2] = logits[1, VOCAB - 3] = 60.0  # ties: the lowest index wins
    got = sampling.sample_argmax(logits, None, seed=0)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0].item() == VOCAB - 1
    # temperature 0 rows take the same argmax inside a sampling batch
    temps = torch.zeros(rows, device=DEVICE)
    assert torch.equal(sampling.sample_argmax(logits, temps, seed=5), got)


def test_sampled_tokens_follow_softmax_over_temperature():
    torch.manual_seed(0)
    vocab, rows, temperature = (64, 32, 0.7) if not ON_GPU else (VOCAB, 256, 0.7)  # CPU: 384 draws, >= 20 per token
    base = torch.full((vocab,), -torch.inf)
    support = torch.tensor([3, 10, 11, vocab - 1])
    base[support] = torch.tensor([1.0, 0.2, -0.5, 0.8])  # -inf elsewhere: masked tokens must never be drawn
    logits = base.to(DEVICE).expand(rows, vocab).contiguous()
    temps = torch.full((rows,), temperature, device=DEVICE)
    draws = torch.cat([sampling.sample_argmax(logits, temps, seed=s) for s in range(12 if not ON_GPU else 64)])
    assert set(draws.unique().tolist()) <= set(support.tolist())
    counts = torch.bincount(draws.cpu(), minlength=vocab)[support].double()
    expected = torch.softmax(base[support] / temperature, 0).double() * len(draws)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 16.3, (counts, expected)  # 3 degrees of freedom: p = 0.001
    # a new seed gives new draws; the same seed the same ones
    a, b = (sampling.sample_argmax(logits, temps, seed=s) for s in (1, 2))
    assert not torch.equal(a, b)
    assert torch.equal(a, sampling.sample_argmax(logits, temps, seed=1))


@pytest.mark.parametrize("cuts", [(VOCAB // 2,), (1_111, 3_333)])
def test_shards_pick_the_token_the_whole_vocabulary_gives(cuts):
    """Tensor-parallel sampling: each vocabulary shard proposes its best (score, global id) and the best of those is
    exactly the unsharded kernel's token, for sampled and greedy rows, with ties across shards going to the
    lowest id. Cuts off the kernel's chunk boundaries, three shards as well as two."""
    from worker.sampler import pick_across_shards

    g = torch.Generator(device=DEVICE).manual_seed(len(cuts))
    rows = 6
    logits = torch.randn(rows, VOCAB, device=DEVICE, generator=g)
    logits[0, 5] = logits[0, VOCAB - 2] = 40.0  # a tie across the first and last shard: the lowest id wins
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.5], device=DEVICE)
    edges = [0, *cuts, VOCAB]
    for temperature in (temps, None):
        want = sampling.sample_argmax(logits, temperature, seed=11)
        candidates = []
        for lo, hi in zip(edges, edges[1:]):
            scores, ids = sampling.shard_best(logits[:, lo:hi], temperature, 11, col_offset=lo, counter_vocab=VOCAB)
            assert ((ids >= lo) & (ids < hi)).all()
            candidates.append(torch.stack([scores.double(), ids.double()], -1))
        assert torch.equal(pick_across_shards(torch.stack(candidates)), want)
        assert want[0].item() == 5
