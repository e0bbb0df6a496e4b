"""The vote collective on real gloo processes, against sign(sum(sign)) computed in numpy."""

import numpy as np
import pytest
import torch

from signmuon.comm_hooks import CommStats, VoteConfig, VoteWork, majority_vote, vote_bytes_per_rank
from tests.harness import run_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cases(world_size: int) -> list[dict]:
    sizes = [1, 7, 8 * world_size + 3, 64 * world_size + 5, 3_000_017]
    cases = []
    for n in sizes:
        for zeros in ("dense", "some", "all_zero_entries"):
            for tie in ("exact", "fast"):
                dtype = list(DTYPES)[len(cases) % 3] if n < 3_000_000 else "fp32"
                cases.append(dict(n=n, zeros=zeros, tie=tie, dtype=dtype, algorithm="auto"))
    # Each algorithm forced at every world size, with forced ties.
    for algorithm in ("two_phase", "all_gather"):
        for tie in ("exact", "fast"):
            cases.append(dict(n=1000, zeros="ties", tie=tie, dtype="fp32", algorithm=algorithm))
    return cases


def _input(case: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible in the parent for the reference."""
    gen = torch.Generator().manual_seed(case["n"] * 31 + rank)
    n = case["n"]
    x = torch.randn(n, generator=gen)
    x[x == 0] = 1.0  # randn does draw exact zeros (about 1 in 10^6); "dense" means none
    if case["zeros"] == "some" and rank == 0:
        x[torch.rand(n, generator=gen) < 0.3] = 0.0
    if case["zeros"] == "all_zero_entries":
        x[::5] = 0.0  # zero on every rank: must vote 0
        x[1::5] = -0.0
    if case["zeros"] == "ties":
        # Half the ranks +1, half -1 on the first 500 entries (a tie for even world sizes).
        x[:500] = 1.0 if rank % 2 == 0 else -1.0
    return x.to(DTYPES[case["dtype"]])


def _vote_worker(rank: int, world_size: int) -> list:
    results = []
    for case in _cases(world_size):
        x = _input(case, rank)
        stats = CommStats()
        seed = 1234 + case["n"]
        if case["n"] == 1:
            out = VoteWork(
                x, config=VoteConfig(tie=case["tie"], algorithm=case["algorithm"]), step=seed, stats=stats
            ).wait()
        else:
            out = majority_vote(
                x, config=VoteConfig(tie=case["tie"], algorithm=case["algorithm"]), step=seed, stats=stats
            )
        assert out.dtype == x.dtype and out.shape == x.shape
        if world_size > 1:  # the time split: every part of a vote is timed on this rank
            assert (
                stats.pack_seconds > 0
                and stats.vote_seconds > 0
                and stats.unpack_seconds > 0
                and stats.wait_seconds > 0
            )
        results.append((out.to(torch.int8), stats.bytes_sent, stats.bytes_received))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_vote_matches_numpy_reference(world_size):
    per_rank = run_distributed(_vote_worker, world_size)
    for i, case in enumerate(_cases(world_size)):
        inputs = np.stack([_input(case, r).float().numpy() for r in range(world_size)])
        reference = np.sign(np.sign(inputs).sum(axis=0))
        outputs = [per_rank[r][i][0] for r in range(world_size)]
        for r in range(1, world_size):
            assert torch.equal(outputs[0], outputs[r]), f"rank {r} differs in {case}"
        got = outputs[0].numpy()
        tie = (reference == 0) & (inputs != 0).any(axis=0)
        all_zero = (inputs == 0).all(axis=0)
        assert (got[all_zero] == 0).all(), f"entries zero on every rank must vote 0: {case}"
        assert np.array_equal(got[~tie], reference[~tie]), case
        if case["tie"] == "exact":
            assert (got[tie] == 0).all(), case
        else:
            assert np.isin(got[tie], [-1, 1]).all(), case
            if tie.sum() > 200:  # unbiased tie-break: about half +1
                assert 0.35 < (got[tie] == 1).mean() < 0.65, case
        if case["zeros"] == "ties" and world_size % 2 == 0:
            assert tie.sum() >= 500, "the forced ties must be ties"
        if case["zeros"] == "dense" and (case["tie"] == "fast" or world_size % 2 == 1):
            # Dense case: one bit per entry, exactly the documented formula.
            expected = vote_bytes_per_rank(case["n"], world_size, case["algorithm"])
            for r in range(world_size):
                assert per_rank[r][i][1] == expected, (case, r)
                assert per_rank[r][i][2] == expected, (case, r)
            bound = 2 * (world_size - 1) / world_size * -(-case["n"] // 8) + (64 + 24) * world_size  # + agreement
            assert expected <= bound


def test_bytes_formula_is_bandwidth_optimal():
    n = 10_000_000
    fp32_ring = 2 * 3 / 4 * 4 * n
    assert fp32_ring / vote_bytes_per_rank(n, 4) > 31.5
    # Two-phase bytes do not grow with the world size; all-gather's do.
    assert vote_bytes_per_rank(n, 64) < 2 * n / 8 + 64 * 64
    assert vote_bytes_per_rank(n, 64, "all_gather") > 60 * n / 8


def test_bad_input():
    with pytest.raises(ValueError, match="floating-point"):
        majority_vote(torch.arange(4))
    with pytest.raises(ValueError, match="sparse"):
        majority_vote(torch.eye(2).to_sparse())
    with pytest.raises(ValueError, match="tie mode"):
        majority_vote(torch.ones(4), config=VoteConfig(tie="coin"))
    with pytest.raises(ValueError, match="algorithm"):
        majority_vote(torch.ones(4), config=VoteConfig(algorithm="tree"))
    with pytest.raises(ValueError, match="out must be"):
        majority_vote(torch.ones(4), out=torch.empty(5))


def test_single_process_is_sign():
    x = torch.tensor([3.0, -2.0, 0.0, -0.0, 1e-30])
    out = majority_vote(x, out=x)
    assert out is x and x.tolist() == [1.0, -1.0, 0.0, 0.0, 1.0]


def _zeros_worker(rank: int, world_size: int, n: int, counts: list) -> list:
    from signmuon.comm_hooks import VoteConfig

    results = []
    for k in counts:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(n, generator=gen)
        x[x == 0] = 1.0
        if rank == 0 and k:
            x[torch.randperm(n, generator=torch.Generator().manual_seed(k))[:k]] = 0.0
        stats = CommStats()
        out = majority_vote(x, config=VoteConfig(tie="fast"), stats=stats)
        inplace = x.clone()
        assert majority_vote(inplace, config=VoteConfig(tie="fast"), out=inplace) is inplace
        assert torch.equal(inplace, out), "in place: the same vote"
        results.append((x, out, stats.bytes_sent))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_few_zeros_cost_o_k_bytes_and_many_cost_one_plane(world_size):
    n = 200_000
    counts = [0, 1, 7, 60, n // 3]
    per_rank = run_distributed(_zeros_worker, world_size, n, counts)
    dense = vote_bytes_per_rank(n, world_size)
    for i, k in enumerate(counts):
        inputs = np.stack([per_rank[r][i][0].numpy() for r in range(world_size)])
        reference = np.sign(np.sign(inputs).sum(axis=0))
        got = per_rank[0][i][1].numpy()
        tie = (reference == 0) & (inputs != 0).any(axis=0)
        assert np.array_equal(got[~tie], reference[~tie]) and np.isin(got[tie], [-1, 1]).all()
        extra = per_rank[0][i][2] - dense  # what rank 0's zeros cost it
        others = [per_rank[r][i][2] - dense for r in range(1, world_size)]
        if k <= 60:  # a list: 4 bytes per zero, plus at most one padding entry per receiving rank
            assert 0 <= extra <= 4 * k + 8 * (world_size - 1), (k, extra)
            assert extra > 0 or k == 0
        else:  # the zero plane is cheaper: at most one more bit per entry sent
            plane = (world_size - 1) * n / 8 / (world_size if world_size > 2 else 1)
            assert extra <= plane + 64 * world_size, (k, extra)
        assert all(o == 0 for o in others), "ranks without zeros send the dense formula"


def test_zero_runs_and_their_plane_follow_the_definition():
    # Runs at word edges, one entry long, spanning words, touching the data's end; padded planes.
    import random

    from signmuon.comm_hooks.kernels import cpu
    from signmuon.comm_hooks.kernels.bits import words_for
    from signmuon.comm_hooks.vote.encodings.zero_codes import plane_from_runs, zero_runs

    rng = random.Random(0)
    for case in range(200):
        n = rng.randint(1, 700)
        x = torch.ones(n)
        for _ in range(rng.randint(0, 8)):
            start = rng.randrange(n)
            x[start : start + rng.choice([1, 2, 63, 64, 65, 128, 200])] = 0.0
        words = words_for(n) + rng.randint(0, 2)
        _, nonzero, _, _ = cpu.pack(x, words)
        zero, expected, i = (x == 0).tolist(), [], 0
        while i < n:  # the definition: maximal runs of zeros, as (start, length)
            j = i
            while j < n and zero[j]:
                j += 1
            if j > i:
                expected.append((i, j - i))
            i = max(j, i + 1)
        starts, lengths = zero_runs(nonzero)
        assert list(zip(starts.tolist(), lengths.tolist())) == expected, case
        assert torch.equal(plane_from_runs(starts, lengths, words), nonzero), case


ROW, ROWS = 96, 2000  # an embedding table: rows of 96 entries (not a multiple of 64)


def _runs_worker(rank: int, world_size: int) -> tuple:
    x = torch.randn(ROWS, ROW, generator=torch.Generator().manual_seed(50 + rank))
    x[x == 0] = 1.0
    x[:500] = 0.0  # tokens absent from every rank's batch: voted zeros, sent back as runs too
    x[600 + 13 * rank : 1900 : 29] = 0.0  # absent from this rank's batch only: 45 isolated rows
    stats = CommStats()
    out = majority_vote(x, config=VoteConfig(tie="fast"), stats=stats)
    return x, out, stats.bytes_sent


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_rows_travel_as_runs_at_a_word_each(world_size):
    results = run_distributed(_runs_worker, world_size)
    inputs = np.stack([r[0].numpy() for r in results])
    reference = np.sign(np.sign(inputs).sum(axis=0))
    tie = (reference == 0) & (inputs != 0).any(axis=0)
    dense = vote_bytes_per_rank(ROWS * ROW, world_size)
    for x, out, sent in results:
        got = out.numpy()
        assert np.array_equal(got[~tie], reference[~tie]) and np.isin(got[tie], [-1, 1]).all()
        assert (got[:500] == 0).all(), "rows zero on every rank stay put"
        # 46 runs of this rank, each split at most once per shard boundary, and the voted rows'
        # run coming back: 8 bytes a run, where a list would cost 4 per zero and a plane n/8.
        runs = 46 + world_size + 1
        assert 0 < sent - dense <= 8 * runs * (world_size - 1) + 8 * world_size, (sent, dense)


def _coin_worker(rank: int, world_size: int, n: int) -> dict:
    from signmuon.comm_hooks.kernels.bits import SignSegments

    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(n, generator=gen)
    x[torch.rand(n, generator=gen) < 0.4] = 0.0  # dead units: 40% exact zeros on every rank
    x[: n // 4] = 0.0  # entries zero on every rank
    x[3 * n // 4 :] = 0.0  # the second segment: zero throughout on every rank
    segments = SignSegments((0, 3 * n // 4, n), (11, 12))
    out = {"x": x}
    for rule in ("abstain", "coin"):
        for seed in (0, 1):
            stats = CommStats()
            voted = majority_vote(x, config=VoteConfig(zeros=rule, seed=seed), step=4, segments=segments, stats=stats)
            out[(rule, seed)] = (voted, stats.bytes_sent)
    for rule in ("abstain", "coin"):  # without the blank segment: what the zeros cost
        stats = CommStats()
        majority_vote(x[: 3 * n // 4].contiguous(), config=VoteConfig(zeros=rule), stats=stats)
        out[rule] = stats.bytes_sent
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_zero_rule_coin_sends_one_bit_and_votes_a_keyed_coin_for_each_zero(world_size):
    from signmuon.comm_hooks.kernels import reference
    from signmuon.comm_hooks.kernels.bits import GOLDEN, MASK64, mix64
    from signmuon.comm_hooks.vote.encodings.sign import ZERO_COIN_SALT, call_key

    n = 4096
    results = run_distributed(_coin_worker, world_size, n)
    dense = vote_bytes_per_rank(3 * n // 4, world_size)
    for r in results:
        assert r["coin"] == dense, "coins: every entry one bit, nothing else"
        assert r["abstain"] > 1.25 * dense, "abstention sends the zeros' positions too"
    # The definition: rank r's zero at entry i of segment s votes tie_bit(key_r, key_s, i).
    key = call_key(0, 4)
    votes = []
    for rank, r in enumerate(results):
        rank_key = mix64(((key ^ ZERO_COIN_SALT) + (rank + 1) * GOLDEN) & MASK64)
        coin = torch.tensor([2.0 * reference.tie_bit(rank_key, 11, i) - 1 for i in range(3 * n // 4)])
        x = r["x"][: 3 * n // 4]
        votes.append(torch.where(x == 0, coin, torch.sign(x)))
    total = torch.stack(votes).sum(0)
    voted = results[0][("coin", 0)][0]
    decided = total != 0
    assert torch.equal(voted[: 3 * n // 4][decided], torch.sign(total[decided]))
    assert bool((voted[: 3 * n // 4] != 0).all()), "no abstention left in the first segment"
    assert bool((voted[3 * n // 4 :] == 0).all()), "a parameter zero throughout stays put"
    assert not torch.equal(voted, results[0][("coin", 1)][0]), "the seed keys the coins"
    assert bool((results[0][("abstain", 0)][0][: n // 4] == 0).all()), "abstention: zero everywhere votes 0"
    for r in results[1:]:
        assert torch.equal(r[("coin", 0)][0], voted), "every rank gets the same vote"


def test_zero_coins_on_unaligned_segments_of_a_slice_follow_the_definition():
    # One voter: the vote is its own signs with coins for its zeros. Segments cut mid-word, the
    # tensor is a slice starting mid-segment (as a node-aware rail votes), one segment is zero
    # throughout in the slice (it abstains) and one only partly inside it.
    from signmuon.comm_hooks.kernels import reference
    from signmuon.comm_hooks.kernels.bits import GOLDEN, MASK64, SignSegments, mix64
    from signmuon.comm_hooks.vote.encodings.sign import ZERO_COIN_SALT, call_key

    first, n = 37, 700
    starts = (0, 101, 230, 231, 500, 613, 900)
    segments = SignSegments(starts, (5, 6, 7, 8, 9, 10), (0, 3, 0, 0, 11, 0))
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x[torch.rand(n, generator=torch.Generator().manual_seed(3)) < 0.3] = 0.0
    x[500 - first : 613 - first] = 0.0  # segment 4: zero throughout
    x[613 - first + 64 :] = 0.0  # the last segment partly zero: its zeros take coins
    for seed, step in ((0, 4), (3, 9)):
        voted = majority_vote(
            x, config=VoteConfig(zeros="coin", seed=seed), step=step, segments=segments, first_entry=first
        )
        rank_key = mix64(((call_key(seed, step) ^ ZERO_COIN_SALT) + GOLDEN) & MASK64)
        expected = torch.sign(x)
        for s, key in enumerate(segments.keys):
            lo, hi = max(starts[s], first), min(starts[s + 1], first + n)
            if hi <= lo or not x[lo - first : hi - first].any():
                continue  # outside the slice, or zero throughout here: abstains
            for e in range(lo, hi):
                if x[e - first] == 0:
                    index = e - starts[s] + segments.first_indices[s]
                    expected[e - first] = 2.0 * reference.tie_bit(rank_key, key, index) - 1
        assert torch.equal(voted, expected), seed
        assert bool((voted[500 - first : 613 - first] == 0).all()) and bool((voted[: 500 - first] != 0).all())


def _mismatch_worker(rank: int, world_size: int, sizes: list) -> str:
    from signmuon.comm_hooks import VoteMismatchError

    try:
        majority_vote(torch.ones(sizes[rank]), label="the test tensor")
    except VoteMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("world_size, sizes", [(2, [1000, 1001]), (3, [64, 64, 60]), (3, [10, 10, 10])])
def test_different_sizes_raise_on_every_rank(world_size, sizes):
    messages = run_distributed(_mismatch_worker, world_size, sizes)
    if len(set(sizes)) == 1:
        assert messages == ["no error"] * world_size
        return
    for message in messages:
        assert "different entries" in message and f"rank {world_size - 1}: entries={sizes[-1]}" in message, message


def test_shards_too_long_for_int32_positions_send_their_zeros_as_planes(monkeypatch):
    """Zero lists and runs hold int32 positions: past 2^31 entries a shard's zeros go as a plane
    (the limit lowered here to a few words), and the vote is still exact."""
    from signmuon.comm_hooks.vote.encodings import zero_codes as codes
    from signmuon.comm_hooks.vote.packing import as_words, pack_nonzero

    x = torch.randn(64 * 63)  # whole words: no padding bits (as_words leaves them clear)
    x[[3, 100, 2000]] = 0.0  # three zeros: a list (two words) is cheapest
    plane = as_words(pack_nonzero(x), x.numel())
    words = plane.numel()
    listed = int(codes.zero_codes(plane.unsqueeze(0), words)[0])
    assert listed & codes.ZERO_LIST and torch.equal(
        codes.plane_of(listed, codes.extra_of(plane, listed), words, "cpu"), plane
    )
    monkeypatch.setattr(codes, "POSITION_LIMIT", 64 * words - 1)
    code = int(codes.zero_codes(plane.unsqueeze(0), words)[0])
    assert code & codes.ZERO_PLANE and code >> 8 == words
    assert torch.equal(codes.plane_of(code, codes.extra_of(plane, code), words, "cpu"), plane)


def _zeros_in_one_part_worker(rank, world_size):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    x[:100] = 0.0  # zeros in part 0 only: rank 0 receives codes with zeros, the others none
    return x, majority_vote(x.clone(), None, VoteConfig(tie="fast"), step=3)


def test_zeros_in_one_part_do_not_split_the_ranks_decisions():
    """Two-phase headers describe the part each rank receives, so whether the second step's
    headers are read must not follow them (a rank skipping a read its peers make hangs)."""
    results = run_distributed(_zeros_in_one_part_worker, 4)
    inputs = torch.stack([x for x, _ in results])
    votes = [v for _, v in results]
    assert all(torch.equal(v, votes[0]) for v in votes)
    total = torch.sign(inputs).sum(dim=0)
    decided = total != 0  # no tie (and not all abstaining)
    assert torch.equal(votes[0][decided], torch.sign(total[decided]))
    assert bool((votes[0][:100] == 0).all())  # every voter abstains there: the zeros travel back


def _negated_encoding_worker(rank, world_size):
    """design.md's recipe for a new encoding, end to end: a class with the Encoding protocol
    (here the sign encoding of the negated tensor), its builder entered in VOTE_ENCODINGS, and a
    VoteConfig naming it; the hooks and optimizers take the same config."""
    from signmuon.comm_hooks.vote.encodings import VOTE_ENCODINGS, SignEncoding

    class NegatedSigns(SignEncoding):
        __slots__ = ()

        def encode(self, flat, plan):
            return super().encode(-flat, plan)

    VOTE_ENCODINGS["negated"] = NegatedSigns.for_vote
    torch.manual_seed(rank)
    x = torch.randn(1000)
    plain = majority_vote(x.clone(), None, VoteConfig(tie="exact"))
    stats = CommStats()
    negated = majority_vote(x.clone(), None, VoteConfig(tie="exact", encoding="negated"), stats=stats)
    return plain, negated, stats.bytes_sent


@pytest.mark.parametrize("world_size", [3, 4])
def test_an_encoding_named_by_the_config_is_the_one_sent(world_size):
    results = run_distributed(_negated_encoding_worker, world_size)
    plain, negated, sent = results[0]
    assert plain.abs().sum() > 0 and torch.equal(negated, -plain)
    assert all(torch.equal(r[1], negated) for r in results[1:]), "every rank decodes the same vote"
    assert sent > 0
    with pytest.raises(ValueError, match="encoding='negated' names no vote encoding.*'sign'"):
        VoteConfig(encoding="negated")  # registered in the workers only


def test_the_old_name_of_vote_work_warns_and_votes_the_same():
    from signmuon.comm_hooks import majority_vote_async

    x = torch.randn(100)
    with pytest.warns(DeprecationWarning, match="VoteWork"):
        work = majority_vote_async(x.clone())
    assert isinstance(work, VoteWork) and torch.equal(work.wait(), majority_vote(x.clone()))


def test_the_old_name_of_the_mean_all_reduce_future_warns_and_averages_the_same():
    from signmuon.comm_hooks import allreduce_mean, mean_all_reduce_future

    x = torch.randn(10)
    with pytest.warns(DeprecationWarning, match="mean_all_reduce_future"):
        old = allreduce_mean(x.clone(), None).wait()
    assert torch.equal(old, mean_all_reduce_future(x.clone(), None).wait())
