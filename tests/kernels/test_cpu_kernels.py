"""radixlang's compiled CPU kernels (kernels/cpu) against the PyTorch ops they replace."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlang.kernels import cpu
from radixlang.kernels.cpu import build
from radixlang.runtime.models.llama import _apply_rope

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


@pytest.mark.parametrize("n,d", [(1, 576), (7, 64), (300, 576), (3, 33)])
def test_rms_norm_matches_torch(n, d):
    torch.manual_seed(0)
    x, w = torch.randn(n, 2 * d)[:, :d], torch.randn(d)  # strided rows
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), F.rms_norm(x, (d,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,d", [(1, 576), (5, 64), (200, 576)])
def test_add_rms_norm_updates_residual_and_normalizes(n, d):
    torch.manual_seed(1)
    x, residual, w = torch.randn(n, d), torch.randn(n, d), torch.randn(d)
    total = x + residual
    cpu.add_rms_norm_(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, total, rtol=0, atol=0)
    torch.testing.assert_close(x, F.rms_norm(total, (d,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,q_heads,kv_heads,d", [(1, 9, 3, 64), (6, 4, 2, 16), (130, 8, 8, 128)])
def test_rope_rotates_q_and_k_inside_qkv(n, q_heads, kv_heads, d):
    torch.manual_seed(2)
    heads = q_heads + kv_heads
    qkv = torch.randn(n, (heads + kv_heads) * d)  # q, k, v side by side, as the fused projection leaves them
    v_before = qkv[:, heads * d:].clone()
    angles = torch.randn(512, d // 2).repeat(1, 2)
    cos, signed_sin = angles.cos(), angles.sin()
    signed_sin[:, :d // 2] *= -1
    pos = torch.randint(0, 512, (n,))
    qk = qkv[:, :heads * d].view(n, heads, d)
    expect = _apply_rope(qk, cos[pos][:, None], signed_sin[pos][:, None])
    cpu.rope_(qk, pos, cos, signed_sin)
    torch.testing.assert_close(qk, expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * d:], v_before)  # v untouched


def test_rope_refuses_positions_outside_the_table():
    cos = torch.ones(8, 4)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 8\)"):
        cpu.rope_(torch.zeros(2, 1, 4), torch.tensor([3, 8]), cos, cos)


@pytest.mark.parametrize("n,inter", [(1, 1536), (4, 40), (300, 1536)])
def test_silu_mul_matches_torch(n, inter):
    torch.manual_seed(3)
    gu = torch.randn(n, 2 * inter) * 6
    gu[0, :4] = torch.tensor([-100.0, -87.5, 60.0, 0.0])  # past the exp clamp on both sides, and zero
    expect = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(cpu.silu_mul(gu), expect, rtol=2e-6, atol=1e-6)


def test_store_kv_writes_strided_rows_at_their_slots():
    torch.manual_seed(4)
    n, heads, d = 5, 3, 8
    qkv = torch.randn(n, (4 + 2 * heads) * d)
    k = qkv[:, 4 * d:(4 + heads) * d].view(n, heads, d)
    v = qkv[:, (4 + heads) * d:].view(n, heads, d)
    k_buf, v_buf = torch.zeros(20, heads, d), torch.zeros(20, heads, d)
    loc = torch.tensor([7, 2, 19, 11, 3])
    cpu.store_kv(k, v, k_buf, v_buf, loc)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()
    with pytest.raises(ValueError, match=r"loc must lie in \[0, 20\)"):
        cpu.store_kv(k, v, k_buf, v_buf, torch.tensor([7, 2, 20, 11, 3]))


def _decode_reference(q, k_buf, v_buf, r2t, req_idx, seq_lens, scale):
    outs = []
    for b in range(q.shape[0]):
        loc = r2t[req_idx[b], :seq_lens[b]].long()
        rep = q.shape[1] // k_buf.shape[1]
        k = k_buf[loc].repeat_interleave(rep, 1).transpose(0, 1)  # [hq, L, d]
        v = v_buf[loc].repeat_interleave(rep, 1).transpose(0, 1)
        p = (torch.einsum("hd,hld->hl", q[b].double(), k.double()) * scale).softmax(-1)
        outs.append(torch.einsum("hl,hld->hd", p, v.double()).float())
    return torch.stack(outs)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 2, 16), (6, 1, 80)])
def test_decode_attention_matches_reference(hq, hkv, d):
    torch.manual_seed(5)
    slots = 3000
    k_buf, v_buf = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    lens = [1, 2, 17, 300, 64, 1000]
    r2t = torch.zeros(len(lens) + 3, 1024, dtype=torch.int32)
    req_idx = torch.tensor([5, 1, 8, 0, 2, 3])  # rows of req_to_token in any order
    free = torch.randperm(slots - 1) + 1  # scattered slots, as a long-running pool hands them out
    start = 0
    for row, n in zip(req_idx.tolist(), lens):
        r2t[row, :n] = free[start:start + n].to(torch.int32)
        start += n
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d) * 3
    q = qkv[:, :hq * d].view(len(lens), hq, d)  # strided rows, as the model passes q
    seq_lens = torch.tensor(lens)
    out = cpu.decode_attention(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
    expect = _decode_reference(q, k_buf, v_buf, r2t, req_idx, seq_lens, d ** -0.5)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=2e-6)


def test_decode_attention_checks_its_metadata():
    k_buf = torch.zeros(10, 2, 8)
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match=r"req_pool_indices must lie in \[0, 4\)"):
        cpu.decode_attention(q, k_buf, k_buf, r2t, torch.tensor([0, 4]), torch.tensor([1, 1]), 1.0)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 17\)"):
        cpu.decode_attention(q, k_buf, k_buf, r2t, torch.tensor([0, 1]), torch.tensor([1, 17]), 1.0)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous int64"):
        cpu.decode_attention(q, k_buf, k_buf, r2t, torch.tensor([0, 1]), torch.tensor([1, 1], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="q .* does not fit"):
        cpu.decode_attention(torch.zeros(2, 3, 8), k_buf, k_buf, r2t, torch.tensor([0, 1]), torch.tensor([1, 1]), 1.0)


def _extend_case(hq, hkv, d, reqs, slots=6000):
    """Pool, req_to_token rows (scattered slots, rows in any order) and strided q for (prefix, extend) requests."""
    k_buf, v_buf = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    r2t = torch.zeros(len(reqs) + 3, 2048, dtype=torch.int32)
    req_idx = torch.randperm(len(reqs) + 3)[:len(reqs)]
    free = torch.randperm(slots - 1) + 1
    start = 0
    for row, (p, e) in zip(req_idx.tolist(), reqs):
        r2t[row, :p + e] = free[start:start + p + e].to(torch.int32)
        start += p + e
    ext = torch.tensor([e for _, e in reqs])
    qkv = torch.randn(int(ext.sum()), (hq + 2 * hkv) * d) * 3
    q = qkv[:, :hq * d].view(-1, hq, d)  # strided rows, as the model passes q
    return q, k_buf, v_buf, r2t, req_idx, torch.cumsum(ext, 0) - ext, torch.tensor([p for p, _ in reqs]), ext


def _extend_reference(q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext, scale, window=None, softcap=None,
                      sinks=None):
    """Causal attention after each request's prefix, in float64; optionally as transformers applies a sliding
    window (position i sees j when i - j < window), logit soft-capping (after the scale) and sinks (one logit
    per head in each softmax's denominator)."""
    out = torch.empty(q.shape)
    rep = q.shape[1] // k_buf.shape[1]
    for b in range(len(req_idx)):
        p, e, s = int(prefix[b]), int(ext[b]), int(q_start[b])
        loc = r2t[req_idx[b], :p + e].long()
        k = k_buf[loc].repeat_interleave(rep, 1).double()  # [L, hq, d]
        v = v_buf[loc].repeat_interleave(rep, 1).double()
        scores = torch.einsum("thd,lhd->htl", q[s:s + e].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i, j = torch.arange(p, p + e)[:, None], torch.arange(p + e)[None, :]
        seen = (j <= i) & ((i - j < window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, e, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[s:s + e] = torch.einsum("htl,lhd->thd", probs, v).float()
    return out


# (prefix, extend) per request: fresh prompts, one-token extends (decodes in a mixed batch), questions
# after a cached prefix, prompts spanning many 16-token query blocks and more than one 128-token work
# item, a prefix just past 32 keys
REQS = [(0, 1), (0, 7), (5, 1), (0, 70), (40, 17), (300, 16), (33, 3), (1000, 40), (0, 300), (20, 130)]


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (2, 2, 256)])
def test_extend_attention_matches_reference(hq, hkv, d):
    torch.manual_seed(6)
    args = _extend_case(hq, hkv, d, REQS)
    out = cpu.extend_attention(*args, d ** -0.5)
    torch.testing.assert_close(out, _extend_reference(*args, d ** -0.5), rtol=1e-4, atol=1e-5)  # float32 sums


def test_extend_attention_checks_its_metadata():
    q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext = _extend_case(4, 2, 64, [(3, 2), (0, 4)])
    with pytest.raises(ValueError, match="head_dim must be a multiple of 64"):
        cpu.extend_attention(torch.zeros(6, 4, 32), torch.zeros(10, 2, 32), torch.zeros(10, 2, 32), r2t, req_idx,
                             q_start, prefix, ext, 1.0)
    with pytest.raises(ValueError, match="queries or slots run past"):
        cpu.extend_attention(q, k_buf, v_buf, r2t, req_idx, torch.tensor([0, 3]), prefix, ext, 1.0)
    with pytest.raises(ValueError, match="queries or slots run past"):
        cpu.extend_attention(q, k_buf, v_buf, r2t, req_idx, q_start, torch.tensor([2047, 0]), ext, 1.0)
    with pytest.raises(ValueError, match=r"req_pool_indices must lie in \[0, 5\)"):
        cpu.extend_attention(q, k_buf, v_buf, r2t, torch.tensor([0, 5]), q_start, prefix, ext, 1.0)
    assert not cpu.extend_fits(80, 4, 4) and not cpu.extend_fits(64, 6, 4) and cpu.extend_fits(128, 8, 2)


FEATURES = [(16, None, False), (None, 5.0, False), (None, None, True), (40, 8.0, True), (1, None, False)]


@pytest.mark.parametrize("window,softcap,with_sinks", FEATURES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 16)])
def test_decode_attention_with_window_softcap_and_sinks(hq, hkv, d, window, softcap, with_sinks):
    torch.manual_seed(7)
    reqs = [(p - 1, 1) for p in (1, 2, 16, 17, 41, 300)]  # a decode is an extend of one token
    q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext = _extend_case(hq, hkv, d, reqs)
    sinks = torch.randn(hq) * 2 if with_sinks else None
    out = cpu.decode_attention(q, k_buf, v_buf, r2t, req_idx, prefix + 1, d ** -0.5, window=window,
                               softcap=softcap, sinks=sinks)
    expect = _extend_reference(q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext, d ** -0.5, window, softcap,
                                 sinks)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("window,softcap,with_sinks", FEATURES)
def test_extend_attention_with_window_softcap_and_sinks(window, softcap, with_sinks):
    torch.manual_seed(8)
    hq, hkv, d = 6, 2, 64
    args = _extend_case(hq, hkv, d, REQS)
    sinks = torch.randn(hq) * 2 if with_sinks else None
    out = cpu.extend_attention(*args, d ** -0.5, window=window, softcap=softcap, sinks=sinks)
    expect = _extend_reference(*args, d ** -0.5, window, softcap, sinks)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)


def test_attention_features_are_checked():
    q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext = _extend_case(4, 2, 64, [(3, 1)])
    with pytest.raises(ValueError, match="one logit per query head"):
        cpu.decode_attention(q, k_buf, v_buf, r2t, req_idx, prefix + 1, 1.0, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="must be positive"):
        cpu.extend_attention(q, k_buf, v_buf, r2t, req_idx, q_start, prefix, ext, 1.0, window=-3)


@pytest.mark.parametrize("bad", ["dtype", "stride"])
def test_wrappers_refuse_what_the_c_code_cannot_read(bad):
    x = torch.randn(3, 16, dtype=torch.float64) if bad == "dtype" else torch.randn(16, 3).t()
    with pytest.raises(ValueError, match="float32 CPU tensor" if bad == "dtype" else "unit stride"):
        cpu.rms_norm(x, torch.ones(16), 1e-6)


def test_one_openmp_runtime_in_the_process():
    # the library must share PyTorch's libgomp (one thread team), not load the system's copy beside it
    code = ("import torch; from radixlang.kernels import cpu; assert cpu.available(); "
            "cpu.silu_mul(torch.randn(64, 4096)); "
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    gomps = eval(out.strip().splitlines()[-1])
    assert len(gomps) == 1, gomps


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path))
    path = build.library_path()
    assert path.parent == tmp_path / "kernels" and path.exists()
    mtime = path.stat().st_mtime_ns
    assert build.library_path() == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind


def test_build_error_names_the_compiler_failure(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path / "cache"))
    with pytest.raises(build.BuildError, match="compiling bad.c failed"):
        build.library_path()
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match="no C compiler found"):
        build.library_path()


@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (2, 203, 96), (3, 5, 1537), (4, 70, 576), (7, 33, 40),
                                   (1, 49152, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(m, n, k, bias):
    torch.manual_seed(6)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(cpu.linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="x has 7 features"):
        cpu.linear(torch.randn(m, 7), w)
