"""The fused sampling kernel (kernels/sampling.py) under the interpreter, fp32: against its
torch reference, against the engine's torch path on the same candidates, and inside the
sampler against the CPU path (same tokens for the same seeds)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen_data.sample.draw import token_draw  # noqa: E402
from batchgen_data.sample.sampler import Sampler, kernel_race  # noqa: E402
from batchgen_data.core.sequence import Sequence  # noqa: E402
from batchgen_data.kernels import reference  # noqa: E402
from batchgen_data.kernels.sampling import race_candidates  # noqa: E402
from batchgen_data.sampling_params import SamplingParams  # noqa: E402


def _candidates(n: int, c: int, ranked: bool, spread: float = 3.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    vals = torch.randn(n, c) * spread
    ids = torch.stack([torch.randperm(5000)[:c] for _ in range(n)])
    if ranked:
        vals, order = vals.sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
    vals[0, c - 3:] = float("-inf")  # padding at the end of a row
    return vals.contiguous(), ids.contiguous()


CASES = {
    "temperature": dict(ranked=False, top_p=False, min_p=False, total=False),
    "min_p": dict(ranked=False, top_p=False, min_p=True, total=False),
    "top_k": dict(ranked=True, top_p=False, min_p=False, total=False),
    "top_k_top_p": dict(ranked=True, top_p=True, min_p=False, total=False),
    "top_p_total": dict(ranked=True, top_p=True, min_p=True, total=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("c", [7, 40])
def test_kernel_matches_reference_and_the_torch_path(case: str, c: int) -> None:
    cfg = CASES[case]
    n = 6
    vals, ids = _candidates(n, c, cfg["ranked"])
    temp = torch.tensor([[0.5], [0.8], [1.0], [1.3], [2.0], [0.7]])
    top_k = torch.tensor([[c], [3], [c], [10], [1], [c + 5]]) if cfg["ranked"] else \
        torch.full((n, 1), 10**6)
    top_p = torch.tensor([[0.5], [0.9], [1.0], [0.3], [0.95], [0.99]]) if cfg["top_p"] else None
    min_p = torch.tensor([[0.0], [0.05], [0.2], [0.0], [0.5], [0.01]]) if cfg["min_p"] else None
    seeds = torch.tensor([0, 1, 2**40 + 3, 7, 123456789, 2**62 - 1])
    steps = torch.tensor([0, 5, 17, 1000, 3, 64])
    total = None
    if cfg["total"]:  # a mass from beyond the candidates, as for a top-p row without top_k
        s = vals / temp
        total = torch.exp(s - s[:, :1]).nan_to_num(0.0).sum(-1, keepdim=True) * 1.25
    args = (vals, ids, temp, top_k, top_p, min_p, seeds, steps, total, cfg["ranked"])
    tok, best, settled = race_candidates(*args, block=16)  # several blocks per row
    r_tok, r_best, r_settled = reference.race_candidates(*args)
    assert torch.equal(tok, r_tok)
    torch.testing.assert_close(best, r_best, atol=1e-5, rtol=1e-5)
    assert torch.equal(settled, r_settled)
    rows = token_draw.Rows(seeds, steps, temp, top_k, top_p, min_p)
    e_tok, e_best, e_settled = token_draw.race_over_candidates(vals, ids, rows, total,
                                                               cfg["ranked"])
    assert torch.equal(tok, e_tok)
    torch.testing.assert_close(best, e_best, atol=1e-5, rtol=1e-5)
    if cfg["top_p"]:
        assert torch.equal(settled, e_settled)


def test_the_hash_is_the_engines() -> None:
    # the race values of a single candidate per row are s - log(-log u): the kernel's u is
    # the engine's, bit for bit before the logs
    n = 64
    seeds = torch.randint(0, 2**62, (n,))
    steps = torch.randint(0, 10**6, (n,))
    ids = torch.randint(0, 200000, (n, 1))
    vals = torch.zeros(n, 1)
    _, best, _ = race_candidates(vals, ids, torch.ones(n, 1), torch.full((n, 1), 1),
                                 None, None, seeds, steps, None, True)
    u = token_draw.hash_uniform_at(seeds, steps, ids).squeeze(1)
    torch.testing.assert_close(best, -torch.log(-torch.log(u)), atol=1e-6, rtol=1e-6)


def _seqs(params: list[SamplingParams], step: int) -> list[Sequence]:
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], p, seed=31 * i + 5, max_tokens=99)
            for i, p in enumerate(params)]
    for s in seqs:
        s.token_ids.extend([4] * step)
    return seqs


def test_sampler_with_the_kernel_draws_the_cpu_paths_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the sampler as on CUDA (the kernel for the candidates, padded rows) against the CPU path
    monkeypatch.setattr(token_draw, "BAND_TOP_P", 1.0)  # the second top-p pass runs too
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.95),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.9), SamplingParams(min_p=0.1),
              SamplingParams(temperature=0), SamplingParams(top_p=0.6, min_p=0.02)]
    gen = torch.Generator().manual_seed(11)
    cpu, gpu_like = Sampler(set()), Sampler(set())
    gpu_like._races[torch.device("cpu")] = kernel_race
    for step in range(4):
        logits = torch.randn(len(params), 700, generator=gen) * (3.0 if step % 2 else 1.0)
        want = cpu(logits, _seqs(params, step)).token_ids
        got = gpu_like(logits, _seqs(params, step)).token_ids
        assert got == want


@pytest.mark.parametrize("call, match", [
    (lambda: race_candidates(torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3).long(),
                             torch.ones(2), torch.ones(2).long(), None, None,
                             torch.zeros(2).long(), torch.zeros(2).long(), None, True), "dtype"),
    (lambda: race_candidates(torch.zeros(2, 3), torch.zeros(2, 4).long(), torch.ones(2),
                             torch.ones(2).long(), None, None, torch.zeros(2).long(),
                             torch.zeros(2).long(), None, True), "ids must have shape"),
    (lambda: race_candidates(torch.zeros(2, 3), torch.zeros(2, 3).long(), torch.ones(2),
                             torch.ones(2).long(), torch.ones(2), None, torch.zeros(2).long(),
                             torch.zeros(2).long(), None, False), "ranked"),
    (lambda: race_candidates(torch.zeros(2, 3), torch.zeros(2, 3).long(), torch.ones(3),
                             torch.ones(2).long(), None, None, torch.zeros(2).long(),
                             torch.zeros(2).long(), None, True), "temperature must have shape"),
])
def test_validation(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
