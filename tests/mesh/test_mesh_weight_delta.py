"""Delta weight sync: what crosses hosts is the changed serving-dtype bits, bitwise exact.

The codec is checked against a reference written here (the sparse-word
format parsed in plain Python, LZ4 blocks decoded by python-lz4, a run
rebuilt as base XOR the decoded bits, element by element), on random
bf16/fp32 data with NaN payloads, -0.0 and infinities; malformed sparse
sections are refused without a byte written outside their run. The mesh test runs an FSDP trainer
(2 gloo ranks, the dense model; EP=2 experts for MoE) and two bf16
generators on two Monarch `ProcessJob` fake hosts for 20 steps: after every
sync (sync mode's `sync()`; async mode's publish, then each generator loading
alone, for two steps) each generator's digest equals the trainer's own export
rounded to bf16, deltas cross hosts except on anchors, a respawned reader and
a restarted trainer get anchors, a host two versions behind gets the full
runs, a flipped bit in the remote host's base is caught by the checksum, and a
trainer rank whose background encoding fails (`COMPOSER_MESH_FAIL_AT`) is read
whole, then raises at its next publication. The background encoder's own
tests stream its chunks in-process: every version rebuilt bitwise, a
publication while the previous encoding runs, a failed encoding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from composer_mesh.actors.chaos import FAIL_ENV, MARKS_ENV
from composer_mesh.actors.weight_sync.delta import FULL, SPARSE, XOR, Delta, DeltaBase, RunDelta, apply_delta, runs_checksum
from composer_mesh.actors.weight_sync.encoder import BackgroundEncoder
from composer_mesh.actors.weight_sync.segment import Piece
from composer_mesh.titan_ext.batch import TrainBatch

VOCAB = 2048  # the tiny models' vocabulary
# the codec test's block (input bytes): its runs span several
BLOCK = 4096

# ---- the codec against a reference ----------------------------------------------------------------


def _payload(values: torch.Tensor, runs: list[Piece]) -> torch.Tensor:
    """A segment payload holding `values`' bytes at every run (zeros between)."""
    raw = values.view(torch.uint8)
    out = torch.zeros(max(r.offset + r.nbytes for r in runs) + 64, dtype=torch.uint8)
    at = 0
    for r in runs:
        out[r.offset : r.offset + r.nbytes] = raw[at : at + r.nbytes]
        at += r.nbytes
    return out


def _advance(base: DeltaBase, payload_U8: torch.Tensor, runs: list[Piece], version: int, token: str,
             itemsize: int, encode: bool) -> tuple[Delta, torch.Tensor] | None:
    """The whole delta of one publication at once (what the background encoder streams in chunks): with
    `encode` and a base of the same runs, the `Delta` against it and its bytes; else None (the base refreshed)."""
    if not encode or not base.matches(payload_U8, runs):
        base.refresh(payload_U8, runs, version, token)
        return None
    sections, out, at = [], [], 0
    base_version, base_token = base.version, base.token
    checksum = 0
    for rd, section, chained in base.encode_runs(payload_U8, runs, version, token, itemsize):
        sections.append(section)
        out.append(dataclasses.replace(rd, at=at))
        at += section.size
        checksum = chained
    # the checksum the encoder chains block by block is the reference's, run by run
    assert checksum == runs_checksum(payload_U8, runs)
    buffer = torch.from_numpy(np.concatenate(sections)) if sections else torch.empty(0, dtype=torch.uint8)
    return Delta(version, base_version, base_token, itemsize, out, buffer.numel(), checksum), buffer


def _reference_sparse(section: bytes, run_bytes: int, itemsize: int) -> bytes:
    """The XOR bits a SPARSE section stands for, parsed from the format in `actors.weight_sync.sparse`'s
    docstring with plain Python (one block: `run_bytes` at most BLOCK): per entry a LEB128 word gap, a lane mask
    byte, then each masked lane's `itemsize` bytes."""
    xor, p, w = bytearray(run_bytes), 0, 0
    while p < len(section):
        gap, shift = 0, 0
        while True:
            c = section[p]
            p += 1
            gap |= (c & 127) << shift
            shift += 7
            if c < 128:
                break
        w += gap
        mask = section[p]
        p += 1
        for lane in range(8 // itemsize):
            if mask >> lane & 1:
                at = 8 * w + itemsize * lane
                assert at + itemsize <= run_bytes, "a lane past the run"
                xor[at : at + itemsize] = section[p : p + itemsize]
                p += itemsize
        w += 1
    return bytes(xor)


def _reference_blocks(rd, section: bytes, itemsize: int) -> bytes:
    """The XOR bits of a SPARSE or XOR run, block by block (each BLOCK input bytes, the last shorter)."""
    import lz4.block

    ends = np.cumsum((0, *rd.blocks))
    out = []
    for i, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
        size = min(BLOCK, rd.run.nbytes - i * BLOCK)
        if rd.encoding == SPARSE:
            out.append(_reference_sparse(section[a:b], size, itemsize))
        else:
            blk = np.frombuffer(lz4.block.decompress(section[a:b], uncompressed_size=size), np.uint8)
            # fp32: each block is its elements' byte 0s, then byte 1s, ... (byte planes)
            out.append(blk.reshape(itemsize, -1).T.tobytes() if itemsize == 4 else blk.tobytes())
    return b"".join(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_rebuilds_every_bit_and_falls_back_to_full(dtype):
    g = torch.Generator().manual_seed(3)
    size = dtype.itemsize
    bits = {2: np.int16, 4: np.int32}[size]
    # four runs (tensors' local shards): scattered changes (SPARSE), all noise (FULL), every element's lowest bit
    # flipped (too dense for SPARSE, one repeated pattern for LZ4: XOR), and an odd element count, so its last
    # 64-bit word is short, with a change in its very last element (SPARSE)
    n = [64 * 33, 1000, 50_000, 1001]
    runs, offset = [], 128
    for k in n:
        runs.append(Piece(offset, k * size))
        offset += k * size + 64 * 3
    old = torch.randn(sum(n), generator=g) * 0.02
    old[7], old[8], old[9] = float("nan"), float("inf"), -0.0
    old_p = _payload(old.to(dtype), runs)
    new_p = old_p.clone()
    views = [new_p[r.offset : r.offset + r.nbytes].numpy().view(bits) for r in runs]
    # 3 % of the elements move by a few low bits, NaN's sign flips and -0.0 becomes +0.0 (bit changes all)
    for v in (views[0], views[3]):
        moved = torch.randperm(v.size, generator=g)[: max(1, v.size * 3 // 100)].numpy()
        v[moved] ^= torch.randint(1, 8, (moved.size,), generator=g).numpy().astype(bits)
    views[3][-1] ^= 1
    views[0][7] ^= np.array(1 << (8 * size - 1), np.uint64).astype(bits)
    views[0][9] = 0
    new_p[runs[1].offset : runs[1].offset + runs[1].nbytes] = torch.randint(0, 256, (runs[1].nbytes,), generator=g,
                                                                            dtype=torch.uint8)
    views[2] ^= 1

    # blocks smaller than the runs, so a run spans several and ends in a partial one
    base = DeltaBase(block_bytes=BLOCK)
    assert _advance(base, new_p, runs, 1, "tok1", size, encode=True) is None  # no base yet: an anchor
    _advance(base, old_p, runs, 0, "tok0", size, encode=False)
    old_bytes = old_p.clone()
    delta, buffer = _advance(base, new_p, runs, 1, "tok1", size, encode=True)
    # the base is read where it was published, never written: the previous version stays readable
    assert torch.equal(old_p, old_bytes) and base.payload_U8 is new_p
    assert (delta.version, delta.base_version, delta.base_token) == (1, 0, "tok0")
    assert [rd.encoding for rd in delta.runs] == [SPARSE, FULL, XOR, SPARSE]

    # reference: every element of the rebuilt run is base XOR the decoded bits, equal to the new bits
    for rd in delta.runs:
        old_bits = old_p[rd.run.offset : rd.run.offset + rd.run.nbytes].numpy().view(bits)
        new_bits = new_p[rd.run.offset : rd.run.offset + rd.run.nbytes].numpy().view(bits)
        assert rd.changed == int((old_bits != new_bits).sum())
        section = buffer[rd.at : rd.at + rd.size].numpy().tobytes()
        if rd.encoding == FULL:
            rebuilt = np.frombuffer(section, dtype=bits)
        else:
            assert rd.block_bytes == BLOCK and len(rd.blocks) == -(-rd.run.nbytes // BLOCK)
            rebuilt = old_bits ^ np.frombuffer(_reference_blocks(rd, section, size), bits)
        assert np.array_equal(rebuilt, new_bits)
    # SPARSE: about (gap + mask + one lane) per changed element; XOR: LZ4 of one repeated pattern
    sparse_runs = [rd for rd in delta.runs if rd.encoding == SPARSE]
    assert sum(rd.size for rd in sparse_runs) < 0.06 * (size + 2) * sum(rd.run.nbytes // size for rd in sparse_runs)
    assert delta.runs[2].size < delta.runs[2].run.nbytes / 50

    target = torch.full_like(old_p, 7)
    # the checksum applying returns (chained block by block) is the reference's over what it wrote
    assert apply_delta(target, old_p, delta, buffer.clone()) == runs_checksum(target, runs) == delta.checksum
    for r in runs:
        assert torch.equal(target[r.offset : r.offset + r.nbytes], new_p[r.offset : r.offset + r.nbytes])
    # a receiver whose base differs in one bit, in a SPARSE or an XOR run: the checksum says so
    for run in (runs[0], runs[2]):
        stale = old_p.clone()
        stale[run.offset + 1] ^= 1
        assert apply_delta(target, stale, delta, buffer.clone()) == runs_checksum(target, runs) != delta.checksum
    # a truncated or foreign section is refused, not half-applied
    with pytest.raises(ValueError, match="expected"):
        apply_delta(target, old_p, delta, torch.cat([buffer[: delta.runs[2].at + 10],
                                                     torch.zeros(buffer.numel(), dtype=torch.uint8)]))
    # a block of the right size that is not LZ4 of one block's bytes (random bytes: refused by LZ4's
    # bounds-checked decoder, or decoded to the wrong length)
    forged = buffer.clone()
    first, at = delta.runs[2].blocks[0], delta.runs[2].at
    forged[at : at + first] = torch.randint(0, 256, (first,), generator=g, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block 0 (is not an LZ4 block|decoded)"):
        apply_delta(target, old_p, delta, forged)
    # a target that ends inside a run: refused before the decoder writes past it
    with pytest.raises(ValueError, match="-byte target for a"):
        apply_delta(target[: runs[2].offset + 16].clone(), old_p, delta, buffer.clone())
    # decoding over the base itself would destroy the bits it XORs with
    with pytest.raises(ValueError, match="shares memory"):
        apply_delta(old_p, old_p, delta, buffer.clone())

    # other runs (a changed layout): no delta, a new base
    other = [runs[0], runs[1]]
    assert _advance(base, new_p, other, 2, "tok2", size, encode=True) is None
    _advance(base, new_p, runs, 3, "tok3", size, encode=False)
    # the next delta is against v3 (each version in memory of its own, as in the slots of a ring)
    v4 = new_p.clone()
    same, _ = _advance(base, v4, runs, 4, "tok4", size, encode=True)
    # nothing changed: every run SPARSE blocks without an entry, nothing to send
    assert (same.base_version, same.changed, same.nbytes) == (3, 0, 0)
    # a version written over its base's bytes (published again into the same slot): the base is gone, so no
    # delta, and that version is the next base
    assert _advance(base, v4, runs, 5, "tok5", size, encode=True) is None
    assert (base.version, base.token) == (5, "tok5") and base.matches(new_p, runs) and not base.matches(v4, runs)

@pytest.mark.parametrize("itemsize", [2, 4])
def test_a_malformed_sparse_section_is_refused_and_never_written_outside_its_run(itemsize):
    """Handcrafted sections break each rule of the format; random ones must decode or be refused, and the bytes
    around the target run stay untouched either way (the decoder is native code with no bounds checks of its own)."""
    g = np.random.default_rng(11)
    # one block: 13 whole words and a short last word of one lane
    run_bytes = 13 * 8 + itemsize
    guard = 64
    base = torch.from_numpy(g.integers(0, 256, run_bytes, dtype=np.uint8))
    lanes, last_lanes = 8 // itemsize, 1

    def apply(section: bytes) -> torch.Tensor:
        """`section` as a one-run, one-block SPARSE delta onto `base`: the guarded target after applying."""
        padded = torch.full((guard + run_bytes + guard,), 0xA5, dtype=torch.uint8)
        rd = RunDelta(Piece(0, run_bytes), SPARSE, 0, 0, len(section), (len(section),), BLOCK)
        data = torch.frombuffer(bytearray(section + bytes(8)), dtype=torch.uint8)[: len(section)]
        try:
            apply_delta(padded[guard : guard + run_bytes], base, Delta(1, 0, "t", itemsize, [rd], len(section), 0),
                        data)
        finally:
            assert bool((padded[:guard] == 0xA5).all() and (padded[-guard:] == 0xA5).all()), "wrote outside its run"
        return padded[guard : guard + run_bytes]

    lane = bytes(range(1, itemsize + 1))
    # valid: word 0 lane 0, then the short last word's one lane (word 13: 12 words skipped after word 0)
    rebuilt = apply(b"\x00\x01" + lane + bytes([12, 1]) + lane)
    expected = base.clone()
    expected[:itemsize] ^= torch.tensor(list(lane), dtype=torch.uint8)
    expected[-itemsize:] ^= torch.tensor(list(lane), dtype=torch.uint8)
    assert torch.equal(rebuilt, expected)
    assert torch.equal(apply(b""), base)
    bad = {
        "truncated gap": b"\x80",
        "gap past the block": bytes([14, 1]) + lane,
        "a mask naming no lane": b"\x00\x00",
        "a mask naming a lane past the word": b"\x00" + bytes([1 << lanes]) + lane * (lanes + 1),
        "a mask naming a lane the short word lacks": bytes([13, 1 << last_lanes]) + lane * 2,
        "a lane past the section": b"\x00\x03" + lane,
        "trailing bytes": b"\x00\x01" + lane + b"\x00",
        "an endless gap": b"\xff" * 12 + b"\x01\x01" + lane,
    }
    for why, section in bad.items():
        with pytest.raises(ValueError, match="not a sparse block"):
            apply(section)
            pytest.fail(why)
    for _ in range(2000):
        section = g.integers(0, 256, int(g.integers(1, 40)), dtype=np.uint8).tobytes()
        try:
            apply(section)
        except ValueError as e:
            assert "not a sparse block" in str(e)


# ---- the background encoder: streamed chunks, overlap, failures ------------------------------------


def _receive(encoder: BackgroundEncoder, base_p: torch.Tensor, timeout_s: float = 60.0) -> tuple[torch.Tensor, int]:
    """What a reader does with the running job's delta: every chunk, in order, applied to a copy of its base
    `base_p` (fresh bytes elsewhere), the checksum chained chunk by chunk. Returns (the rebuilt payload, chunks)."""
    plan = encoder.job.plan
    target = torch.full_like(base_p, 0x5A)
    checksum, index = 0, 0
    while True:
        runs, data, last, final_checksum = encoder.job.chunk(index, timeout_s)
        part = Delta(plan.version, plan.base_version, plan.base_token, plan.itemsize, runs, len(data), 0)
        # as a reader gets it: bytes
        chained = apply_delta(target, base_p, part, data, checksum)
        checksum = runs_checksum(target, [rd.run for rd in runs], checksum)
        assert chained == checksum
        index += 1
        if last:
            assert checksum == final_checksum, f"v{plan.version}: the chained checksum differs from the trainer's"
            return target, index


def _same_runs(a: torch.Tensor, b: torch.Tensor, runs: list[Piece]) -> bool:
    """Whether payloads `a` and `b` hold the same bytes at every run."""
    return all(torch.equal(a[r.offset : r.offset + r.nbytes], b[r.offset : r.offset + r.nbytes]) for r in runs)


def _bf16_payload(g: torch.Generator, runs: list[Piece], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 master values [n], the payload holding them as bf16 at `runs`)."""
    values = torch.randn(n, generator=g) * 0.02
    return values, _payload(values.to(torch.bfloat16), runs)


def test_background_encoder_streams_chunks_that_rebuild_every_version_bitwise():
    g = torch.Generator().manual_seed(5)
    # 12 runs of 40k bf16 elements with gaps; chunks of about 3 runs
    n_run, k = 40_000, 12
    runs = [Piece(256 + i * (n_run * 2 + 128), n_run * 2) for i in range(k)]
    values, payload = _bf16_payload(g, runs, n_run * k)
    encoder = BackgroundEncoder(chunk_bytes=3 * n_run * 2)
    # the first publication is an anchor: no plan, the base is refreshed in the background
    assert encoder.submit(payload, runs, 0, "t0", 2, encode=True) is None
    held = {0: payload}
    chunk_counts = []
    for version in range(1, 6):
        # an Adam-like step moves some bf16 values; NaN and -0.0 bits on the way
        values = values + 1e-4 * torch.sign(torch.randn(values.numel(), generator=g))
        values[version] = float("nan") if version % 2 else -0.0
        payload = _payload(values.to(torch.bfloat16), runs)
        plan = encoder.submit(payload, runs, version, f"t{version}", 2, encode=True)
        assert (plan.version, plan.base_version, plan.base_token) == (version, version - 1, f"t{version - 1}")
        rebuilt, chunks = _receive(encoder, held[version - 1])
        assert _same_runs(rebuilt, payload, runs), f"v{version}: the rebuilt runs differ"
        held[version] = payload
        chunk_counts.append(chunks)
    assert chunk_counts == [4] * 5, chunk_counts
    encoder.finish()


def test_nothing_is_encoded_until_a_reader_asks_and_a_delta_nobody_asked_for_only_becomes_the_base():
    g = torch.Generator().manual_seed(9)
    runs = [Piece(0, 2 * 50_000), Piece(2 * 50_000 + 64, 2 * 30_000)]
    values, v0 = _bf16_payload(g, runs, 80_000)
    v1 = _payload((values + 1e-3).to(torch.bfloat16), runs)
    v2 = _payload((values + 2e-3).to(torch.bfloat16), runs)
    encoder = BackgroundEncoder()
    assert encoder.submit(v0, runs, 0, "t0", 2, encode=True) is None
    plan = encoder.submit(v1, runs, 1, "t1", 2, encode=True)
    # returned without starting a thread: the publication (which the next step waits for) is not slowed
    job = encoder.job
    assert (plan.base_version, job.thread.ident, job.chunks) == (0, None, [])
    # no reader asked (its host read v1 whole): the next publication makes v1 the base without encoding it
    plan = encoder.submit(v2, runs, 2, "t2", 2, encode=True)
    assert job.finished and job.error is None and job.chunks == []
    assert (plan.base_version, plan.base_token) == (1, "t1")
    rebuilt, chunks = _receive(encoder, v1)
    assert _same_runs(rebuilt, v2, runs) and chunks == 1
    encoder.finish()


def test_a_publication_while_the_previous_encoding_runs_waits_for_it_and_encodes_against_it():
    g = torch.Generator().manual_seed(6)
    # 48 MB of bf16 runs: encoding takes tens of milliseconds at least
    n_run, k = 2_000_000, 12
    runs = [Piece(i * n_run * 2, n_run * 2) for i in range(k)]
    values, v0 = _bf16_payload(g, runs, n_run * k)
    # chunks of one run each: 12 of them
    encoder = BackgroundEncoder(chunk_bytes=n_run * 2)
    encoder.submit(v0, runs, 0, "t0", 2, encode=True)
    encoder.finish()
    v1 = _payload((values + 1e-3).to(torch.bfloat16), runs)
    v2 = _payload((values + 2e-3).to(torch.bfloat16), runs)
    encoder.submit(v1, runs, 1, "t1", 2, encode=True)
    first = encoder.job
    # a reader's first request starts the encoding; v1 is still encoding when v2 is published
    first.chunk(0, 60.0)
    assert first.thread.is_alive() and not first.finished
    plan = encoder.submit(v2, runs, 2, "t2", 2, encode=True)
    assert first.finished and first.error is None and first.chunks[-1][2]
    assert (plan.base_version, plan.base_token) == (1, "t1")
    # v1's chunks, read late, still rebuild v1; v2's rebuild v2 on top
    rebuilt1 = torch.full_like(v0, 0x5A)
    checksum = 0
    for index in range(len(first.chunks)):
        runs_i, data, last, final_checksum = first.chunk(index, 1.0)
        apply_delta(rebuilt1, v0, Delta(1, 0, "t0", 2, runs_i, len(data), 0), data)
        checksum = runs_checksum(rebuilt1, [rd.run for rd in runs_i], checksum)
    assert last and checksum == final_checksum and _same_runs(rebuilt1, v1, runs)
    rebuilt2, _ = _receive(encoder, v1)
    assert _same_runs(rebuilt2, v2, runs)


def test_the_encoding_starts_only_once_the_host_is_sealed_and_a_seal_that_never_comes_fails_it(monkeypatch):
    import threading
    import time

    import composer_mesh.actors.weight_sync.encoder as encoder_mod

    g = torch.Generator().manual_seed(8)
    runs = [Piece(0, 2 * 50_000)]
    values, v0 = _bf16_payload(g, runs, 50_000)
    v1 = _payload((values + 1e-3).to(torch.bfloat16), runs)
    encoder = BackgroundEncoder()
    encoder.submit(v0, runs, 0, "t0", 2, encode=True)
    sealed = threading.Event()
    encoder.submit(v1, runs, 1, "t1", 2, encode=True, ready=sealed.is_set)
    # the other ranks are still copying: no chunk, and the base is still v0
    with pytest.raises(TimeoutError, match="not encoded"):
        encoder.job.chunk(0, 0.3)
    assert encoder.base.version == 0
    sealed.set()
    rebuilt, _ = _receive(encoder, v0)
    assert _same_runs(rebuilt, v1, runs)
    # published again before the host sealed (another rank failed the publication): dropped without an
    # error, the base untouched, so the next publication is still a delta against v1
    encoder.submit(v0, runs, 2, "t2", 2, encode=True, ready=lambda: False)
    time.sleep(0.05)
    plan = encoder.submit(v0, runs, 3, "t3", 2, encode=True)
    assert (plan.base_version, plan.base_token) == (1, "t1")
    rebuilt, _ = _receive(encoder, v1)
    assert _same_runs(rebuilt, v0, runs)
    # a seal that came just before the next publication still counts: that version is encoded
    late = threading.Event()
    encoder.submit(v1, runs, 4, "t4", 2, encode=True, ready=late.is_set)
    late.set()
    plan = encoder.submit(v0, runs, 5, "t5", 2, encode=True)
    assert (plan.base_version, plan.base_token) == (4, "t4")
    # a host that never seals while nobody publishes again: the encoding fails, is never served, and is raised
    monkeypatch.setattr(encoder_mod, "READY_TIMEOUT_S", 0.2)
    encoder.finish()
    encoder.submit(v1, runs, 6, "t6", 2, encode=True, ready=lambda: False)
    with pytest.raises(RuntimeError, match="failed: TimeoutError.*not sealed"):
        encoder.job.chunk(0, 10.0)
    with pytest.raises(RuntimeError, match=r"v6 \(sync t6\): the background delta encode failed"):
        encoder.finish()


def test_a_failed_background_encoding_is_raised_at_the_next_publication_and_never_served():
    g = torch.Generator().manual_seed(7)
    runs = [Piece(0, 6 * 1000), Piece(6 * 1000 + 64, 6 * 500)]
    _, payload = _bf16_payload(g, runs, 1000 * 3 + 500 * 3)
    encoder = BackgroundEncoder()
    encoder.submit(payload, runs, 0, "t0", 3, encode=True)
    # 3-byte elements have no raw-bit view: the encoding fails on the encoder's thread
    plan = encoder.submit(payload.clone(), runs, 1, "t1", 3, encode=True)
    assert plan is not None
    # a reader asking for the delta gets the failure, not bytes
    with pytest.raises(RuntimeError, match=r"background delta encode of v1 \(sync t1\) failed: ValueError"):
        encoder.job.chunk(0, 10.0)
    # the next publication raises it, naming the version
    with pytest.raises(RuntimeError, match=r"v1 \(sync t1\): the background delta encode failed.*anchor"):
        encoder.submit(payload, runs, 2, "t2", 2, encode=True)
    # once: the base is gone, so the publication after it is an anchor, and deltas resume after that
    assert encoder.submit(payload, runs, 2, "t2", 2, encode=True) is None
    plan = encoder.submit(payload.clone(), runs, 3, "t3", 2, encode=True)
    assert (plan.base_version, plan.base_token) == (2, "t2")
    rebuilt, _ = _receive(encoder, payload)
    assert _same_runs(rebuilt, payload, runs)

# ---- 2 fake hosts, 20 steps: dense and MoE ----------------------------------------------------------

ANCHOR_EVERY = 5


@pytest.fixture(scope="module", params=["tiny", "tiny_moe"])
def delta_meshes(request, tiny_assets, tiny_trainer_spec, tmp_path_factory):
    """"trainer_0": the trainer mesh (2 ranks) and one generator; "generator_0": one generator (the reader)."""
    from monarch.job import ProcessJob

    from composer_mesh.actors.generator import GeneratorActor, GeneratorSpec
    from composer_mesh.configs.sections.checkpoint import CheckpointConfig
    from composer_mesh.configs.sections.generator import GeneratorConfig
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.configs.sections.parallelism import ParallelismConfig

    moe = request.param == "tiny_moe"
    model_dir = tiny_assets.moe_dir if moe else tiny_assets.dense_dir
    out = tmp_path_factory.mktemp(f"wdelta_{request.param}")
    base = tiny_trainer_spec(out / "ckpt")
    spec = dataclasses.replace(
        base, model=ModelConfig(flavour=request.param, device="cpu", hf_path=str(model_dir)),
        parallelism=ParallelismConfig(ep=2 if moe else 1),
        # RL-sized constant steps
        optimizer=dataclasses.replace(base.optimizer, lr=1e-5, decay_ratio=0.0),
        trainer=dataclasses.replace(base.trainer, steps=30),
        checkpoint=CheckpointConfig(every_steps=ANCHOR_EVERY, keep_last=2),
    )
    gen_spec = GeneratorSpec(model_dir=str(model_dir), generator=GeneratorConfig(engine="hf", dtype="bfloat16"))
    # a failure of the trainer's background encoding, disarmed: the test removes its mark to arm it (chaos)
    marks = out / "marks"
    marks.mkdir()
    (marks / "trainer-delta_encode").touch()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAIL_ENV, "trainer:delta_encode")
        env.setenv(MARKS_ENV, str(marks))
        job = ProcessJob({"trainer": 1, "generator": 1})
        try:
            state = job.state(cached_path=None)

            def new_generator(host):
                return host.spawn_procs(per_host={"gpus": 1}).spawn("generator", GeneratorActor, gen_spec)

            yield state, spec, new_generator, out
        finally:
            job.kill()


def _flip_a_bit(root: str, host: str) -> None:
    """Flip one bit of the newest sealed version on `host` (its header stays valid)."""
    import os

    from composer_mesh.actors.weight_sync.reader import newest_version
    from composer_mesh.actors.weight_sync.segment import Header, host_dir

    newest = newest_version(root, host)
    for path in host_dir(root, host).glob("slot*.seg"):
        fd = os.open(path, os.O_RDWR)
        try:
            header = Header.read(fd)
            if header is not None and header.complete and header.version == newest:
                at = header.payload_at + header.nbytes // 3
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
                return
        finally:
            os.close(fd)
    raise AssertionError(f"no sealed v{newest} on {host}")


def _trainer(state, spec):
    from composer_mesh.actors.elastic import setup_elastic_env

    from composer_mesh.actors.trainer import TrainerActor

    procs = state.trainer.spawn_procs(per_host={"gpus": 2})
    setup_elastic_env(procs)
    trainer = procs.spawn("trainer", TrainerActor, spec)
    trainer.setup.call().get()
    return procs, trainer


@pytest.mark.slow
def test_deltas_over_20_steps_stay_bitwise_through_respawn_restart_and_lag(delta_meshes):
    from composer_mesh.actors.mesh_utils import rank0
    from composer_mesh.actors.weight_sync.sync import TopologySync

    state, spec, new_generator, out = delta_meshes
    root = str(out / "seg")
    procs, trainer = _trainer(state, spec)
    gens = [new_generator(state.trainer), new_generator(state.generator)]
    remote = "generator_0"

    def sync_checked(sync, step):
        """Sync mode's `sync()`, or (steps 18-19) async mode's parts: publish, then each generator loads alone
        once its host holds the version. Returns (delta on the remote host, cross-host bytes, changed fraction)."""
        if step in (18, 19):
            pub = sync.publish()
            assert all(pub.sealed(sync.host_of(i)) for i in range(len(gens)))
            digest = pub.check([pub.load(g).get() for g in gens])
            pulled = pub.wait_pulls()[remote]
            delta, nbytes, model_bytes = pulled["delta"], pulled["bytes_remote"], pub.model_bytes
            changed, elements = pub.changed, pub.elements
        else:
            report = sync.sync()
            digest, nbytes, model_bytes = report.digest, report.cross_host_bytes, report.model_bytes
            delta, changed, elements = report.delta[remote], report.changed, report.elements
        rounded = rank0(trainer.weights_digest.call("bfloat16").get())
        held = {g.weights_digest.call_one(dtype="bfloat16").get() for g in gens}
        assert digest is not None and held == {rounded}, f"step {step}: generators differ from the trainer"
        if delta:
            assert nbytes < 0.5 * model_bytes, f"step {step}: delta not smaller"
        elif step not in (2, 15):
            # (2 and 15 read one rank's runs whole on top of the other's delta)
            assert nbytes == model_bytes, f"step {step}: an anchor moved {nbytes} of {model_bytes} bytes"
        return delta, changed / elements if elements else None

    sync = TopologySync(trainer, gens, root, keep=2, dtype="bfloat16", anchor_every=ANCHOR_EVERY)
    # the first publication: an anchor
    assert sync_checked(sync, 0) == (False, None)
    kinds, fractions = [], []
    for step in range(1, 21):
        trainer.train_step.call(TrainBatch.synthetic(step, VOCAB)).get()
        # the remote generator respawns: its host's next pull is an anchor
        if step == 7:
            gens[1] = new_generator(state.generator)
            sync = sync.replaced(1, gens[1])
        # another root takes v8 and this one skips it: its remote host stays at v7, two behind v9
        if step == 8:
            TopologySync(trainer, gens, str(out / "other"), keep=2, dtype="bfloat16", anchor_every=2).sync()
            continue
        # the trainer restarts from its step-10 checkpoint: a new process, no base
        if step == 12:
            procs.stop().get()
            procs, trainer = _trainer(state, spec)
            assert rank0(trainer.policy_version.call().get()) == 10
            sync = TopologySync(trainer, gens, root, keep=2, dtype="bfloat16", anchor_every=ANCHOR_EVERY)
        # one bit of the remote host's base flips: its checksum fails, that rank's runs come whole
        if step == 15:
            _flip_a_bit(root, remote)
        # one trainer rank's background encoding fails: the reader reads that rank whole (the generators still
        # get the trainer's weights, checked below), and the next publication raises it, naming the version
        if step == 2:
            (out / "marks" / "trainer-delta_encode").unlink()
        if step == 3:
            with pytest.raises(Exception, match=r"v2 \(sync \w+\): the background delta encode failed"):
                sync.sync()
        delta, fraction = sync_checked(sync, step)
        kinds.append("delta" if delta else "full")
        if delta:
            fractions.append((step, fraction))
    # anchors at every 5th publication of a sync (steps 5 and 11; 17 after the restart's new sync), for the
    # failed encoding (2) and the publication after its error (3: that rank has no base), the respawned reader
    # (7), the host two versions behind (9), the restarted trainer (12) and the corrupted base (15); v8 went
    # elsewhere
    assert kinds == ["delta", "full", "full", "delta"] + ["full", "delta", "full", "full", "delta", "full", "full"] + [
        "delta", "delta", "full", "delta", "full"] + ["delta"] * 3, kinds
    # of the bf16 elements, per delta step
    changed = [round(f, 4) for _, f in fractions]
    assert 0 < min(changed) and max(changed) < 0.5, str(list(zip([k for k, _ in fractions], changed)))
    procs.stop().get()
