"""Zero every non-sm_90 cubin inside a shared library's fat binary, so that the file compresses to what an H200 uses.

Why: transformer_engine_cu13 2.20.2's libtransformer_engine.so is 343 MB, 264 MB of it a fat binary with cubins for
eight GPU architectures (sm_75 ... sm_120), already compressed; the device machine takes 64 MiB per call. An H200
(sm_90) loads only the sm_90 entries (18 MB), and SASS of another major architecture never runs there. CUDA's own
pruning tool (nvprune) is not on this machine nor in the `nvidia-cuda-nvcc` wheel, so this rewrites the payloads in
place: every entry keeps its header, size and offset (nothing in the ELF moves), the other architectures' bytes
become zeros, and xz takes the file from 343 MB to ~23 MB. The result is for sm_90 GPUs only.

    python scripts/te_keep_sm90.py IN.so OUT.so
"""

from __future__ import annotations

import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF_ENTRY = 2  # fat binary entry kinds: 1 PTX, 2 ELF (cubin)
KEEP_ARCH = 90


def _section(data: bytes, wanted: str) -> tuple[int, int]:
    """(file offset, size) of the ELF64 section named `wanted`."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    for name, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names_offset + name)
        if data[names_offset + name : end].decode() == wanted:
            return offset, size
    raise SystemExit(f"no section {wanted} in the input")


def keep_sm90(data: bytearray) -> tuple[int, int]:
    """Zero the payload of every ELF entry for another architecture; (bytes zeroed, bytes kept)."""
    position, size = _section(data, ".nv_fatbin")
    end, zeroed, kept = position + size, 0, 0
    while position < end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, position)
        if magic != FATBIN_MAGIC:  # alignment padding between fat binaries
            position += 8
            continue
        entry, stop = position + header_size, position + header_size + fat_size
        while entry < stop:
            kind, _unknown, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            start = entry + entry_header
            if kind == ELF_ENTRY and arch != KEEP_ARCH:
                data[start : start + payload] = bytes(payload)
                zeroed += payload
            else:
                kept += payload
            entry = start + payload
        position = stop
    return zeroed, kept


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], "rb") as source:
        data = bytearray(source.read())
    zeroed, kept = keep_sm90(data)
    if kept == 0:
        raise SystemExit("no sm_90 cubin found: the result would run nowhere")
    with open(argv[1], "wb") as target:
        target.write(data)
    print(f"{argv[1]}: zeroed {zeroed / 1e6:.1f} MB of other architectures' cubins, kept {kept / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
