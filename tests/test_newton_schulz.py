"""Newton–Schulz against the SVD's U·Vᵀ: properties, not hard-coded outputs."""

import pytest
import torch

from signmuon.optim import as_matrix, newton_schulz

BAND = (0.65, 1.25)  # documented in newton_schulz for singular values >= 3e-3 of ||X||_F


def _with_spectrum(m: int, n: int, singular_values: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = len(singular_values)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    return U @ torch.diag(singular_values) @ V.T


@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (32, 96), (200, 50)])
def test_singular_values_in_band_and_direction_of_svd(shape):
    m, n = shape
    k = min(shape)
    X = _with_spectrum(m, n, torch.logspace(-1.5, 0, k), seed=m + n)  # condition number ~30
    assert (torch.linalg.svdvals(X).min() / X.norm()) >= 3e-3
    Y = newton_schulz(X)
    s = torch.linalg.svdvals(Y)
    assert BAND[0] <= s.min() and s.max() <= BAND[1], s
    # Same singular vectors as the exact polar factor: Y ≈ U·diag(s')·Vᵀ, so <Y, U·Vᵀ> / ||U·Vᵀ||² is
    # the mean singular value and the residual off that direction is the band's spread only.
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    polar = U @ Vh
    cosine = (Y * polar).sum() / (Y.norm() * polar.norm())
    assert cosine > 0.97


def test_rank_deficient_input_keeps_null_space():
    X = _with_spectrum(64, 48, torch.tensor([1.0, 0.7, 0.5, 0.3, 0.2, 0.1]), seed=3)  # rank 6
    s = torch.linalg.svdvals(newton_schulz(X))
    assert BAND[0] <= s[:6].min() and s[:6].max() <= BAND[1]
    assert s[6:].max() < 1e-3


def test_zero_input_gives_zeros_not_nan():
    for shape in [(5, 7), (7, 5), (3, 4, 4)]:
        Y = newton_schulz(torch.zeros(shape))
        assert torch.equal(Y, torch.zeros(shape))


def test_batched_equals_one_by_one():
    X = torch.randn(3, 16, 24)
    batched = newton_schulz(X)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(X[i]), rtol=1e-5, atol=1e-6)


def test_scale_invariant_and_deterministic():
    X = torch.randn(20, 30)
    torch.testing.assert_close(newton_schulz(X), newton_schulz(1000.0 * X), rtol=1e-4, atol=1e-5)
    assert torch.equal(newton_schulz(X), newton_schulz(X))


def test_dtype_argument_and_output_dtype():
    X = torch.randn(16, 16, dtype=torch.float64)
    Y = newton_schulz(X, dtype=torch.bfloat16)
    assert Y.dtype == torch.float64
    torch.testing.assert_close(Y, newton_schulz(X), rtol=0.05, atol=0.05)  # bf16 rounding


def test_conv_kernel_matrix_view():
    w = torch.randn(8, 3, 3, 3)
    assert as_matrix(w).shape == (8, 27)
    with pytest.raises(ValueError, match="1-D"):
        as_matrix(torch.randn(5))


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_bad_steps(steps):
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.randn(4, 4), steps=steps)


def test_vector_rejected():
    with pytest.raises(ValueError, match="2 dimensions"):
        newton_schulz(torch.randn(4))


def test_the_precision_is_the_calls_and_restored(monkeypatch):
    """float32 switches a global TF32 setting off for the call, "tfloat32" switches TF32 on for
    the call; either way the process's setting is back when the call returns."""
    seen = []
    real = torch.Tensor.__matmul__

    def spy(a, b):
        seen.append(torch.get_float32_matmul_precision())
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    x = torch.randn(8, 6)
    for setting, dtype, during in [
        ("high", None, "highest"),
        ("highest", "tfloat32", "high"),
        ("high", "float32", "highest"),
        ("medium", "bfloat16", "medium"),
    ]:
        torch.set_float32_matmul_precision(setting)
        try:
            seen.clear()
            newton_schulz(x, dtype=dtype)
            assert seen and set(seen) == {during}, (setting, dtype, seen)
            assert torch.get_float32_matmul_precision() == setting
        finally:
            torch.set_float32_matmul_precision("highest")
    with pytest.raises(ValueError, match="tfloat32"):
        newton_schulz(x, dtype="tf32")


def test_sign_muon_takes_tfloat32():
    from signmuon.optim import SignMuon

    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = SignMuon([w], lr=0.1, ns_dtype="tfloat32")
    w.grad = torch.randn(8, 6)
    opt.step()
    with pytest.raises(ValueError, match="ns_dtype"):
        SignMuon([w], lr=0.1, ns_dtype="float16")
