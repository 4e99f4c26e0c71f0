"""The device side of the package (issue 14) as far as a host without a GPU
can run it: pool_tensor is a view of the pool on the host backend,
pool_device and set_stream refuse pools that are not in GPU memory with the
reason, stream handles are read from torch-like streams, and
DeviceBuffer describes memory by the CUDA Array Interface. The same calls
on a cuda pool run in the GPU suite (tests/gpu/run.sh, step torch-ppl)."""
import numpy as np
import pytest

from kvstash import FailedPrecondition, Geometry, Session, Unsupported
from kvstash.device import DeviceBuffer, stream_handle

GEO = Geometry(layers=1, q_heads=2, kv_heads=2, head_dim=8, block_tokens=4, dtype="fp16")


def test_pool_tensor_is_a_view_of_the_pool(daemon):
    torch = pytest.importorskip("torch")
    with Session.attach("dev-view", GEO, socket=daemon.sock) as s, s.create_sequence() as seq:
        assert s.backend == "host" and s.device == -1
        lst = seq.append(3).lists[0]
        b = int(lst.segments["block"][0])
        raw = s.pool_tensor()
        assert raw.dtype == torch.uint8 and raw.device.type == "cpu"
        assert raw.numel() == s.pool_bytes
        # K of (block b, head 1, slots 0-2) through the tensor, as fp16.
        rows = raw[b * s.block_bytes:(b + 1) * s.block_bytes].view(torch.float16).view(2, 2, 4, 8)
        rows[0, 1, :3] = torch.arange(24, dtype=torch.float16).view(3, 8)
        k, _ = seq.read(lst)
        assert np.array_equal(k[1], np.arange(24, dtype=np.float16).reshape(3, 8))


def test_pool_device_needs_a_gpu_pool(daemon):
    with Session.attach("dev-none", GEO, socket=daemon.sock) as s:
        with pytest.raises(Unsupported, match="'host' backend, not in GPU memory"):
            s.pool_device()


def test_set_stream_needs_a_gpu_pool(daemon):
    class TorchLikeStream:
        cuda_stream = 0x1234

    with Session.attach("dev-stream", GEO, socket=daemon.sock) as s:
        with pytest.raises(FailedPrecondition, match='"host" backend, which has no device'):
            s.set_stream(TorchLikeStream())
        s.set_stream(None)  # unregistering is always accepted
        s.ping()  # and the session works on


def test_stream_handles():
    class TorchLikeStream:
        cuda_stream = 77

    assert stream_handle(None) is None
    assert stream_handle(5) == 5
    assert stream_handle(TorchLikeStream()) == 77
    assert stream_handle(0) is None  # the legacy default stream: nothing to register
    with pytest.raises(TypeError, match="CUDA stream"):
        stream_handle("stream")
    with pytest.raises(TypeError):
        stream_handle(True)


def test_device_buffer_interface():
    b = DeviceBuffer(0x7f0000001000, 4096, device=1)
    cai = b.__cuda_array_interface__
    assert cai == {"shape": (4096,), "typestr": "|u1", "data": (0x7f0000001000, False),
                   "strides": None, "version": 3, "stream": None}
    assert "device=1" in repr(b)


def test_llama_device_cuda_needs_a_gpu_pool(daemon):
    """python3 -m kvstash.llama --device cuda on a host pool: exit 1 with
    what to do, before any token is scored."""
    import subprocess

    from llama_helpers import TEXT, need_model, torch_cmd
    need_model()
    p = subprocess.run(torch_cmd("score", "--socket", daemon.sock, "--stories", "1", "--text", TEXT,
                                 "--device", "cuda", "--model-name", "dev-llama"),
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "--device cuda: the pool is on kvstashd's 'host' backend" in p.stderr, p.stderr
    assert "--backend cuda" in p.stderr
