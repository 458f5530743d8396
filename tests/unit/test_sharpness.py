"""``benchmarks/sharpness.py``'s preconditioned sharpness against the eigenvalues of ``P^-1/2 H P^-1/2`` computed
directly (float64): the diagnostic that tells 2BW's lag from its stability bound must measure what it says."""

import torch

from benchmarks.sharpness import adam_diagonal, preconditioned_sharpness


def test_the_power_iteration_finds_the_largest_eigenvalue_of_the_preconditioned_hessian():
    torch.manual_seed(0)
    n = 12
    basis = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]
    hessian = basis @ torch.diag(torch.linspace(0.1, 5.0, n, dtype=torch.float64)) @ basis.T
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, dtype=torch.float64))])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return 0.5 * m[0] @ hessian @ m[0]

    for _ in range(3):  # Adam's second moment from real steps: a non-uniform diagonal
        optimizer.zero_grad()
        loss_of(model).backward()
        optimizer.step()
    (diagonal,) = adam_diagonal(list(model.parameters()), [optimizer])
    state = optimizer.state[model[0]]
    assert torch.allclose(diagonal, (state["exp_avg_sq"] / (1 - 0.95 ** float(state["step"]))).sqrt() + 1e-8)
    scale = diagonal.rsqrt()
    expected = torch.linalg.eigvalsh(scale[:, None] * hessian * scale[None, :]).max().item()
    measured = preconditioned_sharpness(model, [optimizer], loss_of, iterations=500)
    # power iteration converges as (second / largest)^k; 500 steps on this spectrum leave far below 1e-6
    assert abs(measured - expected) <= 1e-6 * expected
    unpreconditioned = torch.linalg.eigvalsh(hessian).max().item()
    assert abs(unpreconditioned - expected) > 1e-2 * expected  # the preconditioner matters: the test can fail
