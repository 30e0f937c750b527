"""Reads and normalises serialized xla.HloModuleProto bytes at the protobuf wire level (no protobuf or jax import)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass

# Field numbers from xla/service/hlo.proto and xla/xla_data.proto.
MODULE_NAME, MODULE_ENTRY_NAME, MODULE_COMPUTATIONS, MODULE_HOST_SHAPE, MODULE_ID, MODULE_ENTRY_ID = 1, 2, 3, 4, 5, 6
COMP_NAME, COMP_INSTRUCTIONS, COMP_ID, COMP_ROOT_ID = 1, 2, 5, 6
INSTR_NAME, INSTR_OPCODE, INSTR_SHAPE, INSTR_PARAMETER_NUMBER, INSTR_ID = 1, 2, 3, 9, 35
SHAPE_ELEMENT_TYPE, SHAPE_DIMENSIONS, SHAPE_TUPLE_SHAPES = 2, 3, 4
PROGRAM_SHAPE_PARAMETERS, PROGRAM_SHAPE_RESULT = 1, 2

# xla.PrimitiveType -> the numpy-style dtype name used in params.json.
ELEMENT_TYPES: dict[int, str] = {
    1: "bool", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "uint8", 7: "uint16", 8: "uint32", 9: "uint64",
    10: "float16", 11: "float32", 12: "float64", 13: "tuple", 15: "complex64", 16: "bfloat16", 17: "token",
    18: "complex128", 19: "float8_e5m2", 20: "float8_e4m3fn",
}


class ProtoError(ValueError):
    """The bytes are not a well-formed message of the expected shape."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(data):
            raise ProtoError("truncated varint")
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def iter_fields(data: bytes) -> Iterator[tuple[int, int, int | bytes, int, int]]:
    """(field number, wire type, value, start, end) of each top-level field; ProtoError on malformed bytes."""
    i = 0
    while i < len(data):
        start = i
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ProtoError("field number 0")
        value: int | bytes
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(data, i)
            value, i = data[i:i + n], i + n
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ProtoError(f"unsupported wire type {wire} (field {field})")
        if i > len(data):
            raise ProtoError(f"truncated field {field}")
        yield field, wire, value, start, i


def strip_field(data: bytes, number: int) -> bytes:
    """The message without any top-level occurrence of field `number` (other bytes untouched)."""
    out = bytearray()
    for field, _wire, _value, start, end in iter_fields(data):
        if field != number:
            out += data[start:end]
    return bytes(out)


def strip_module_id(data: bytes) -> bytes:
    """HloModuleProto.id is a per-process counter (the n-th module lowered); dropping it makes the bytes stable."""
    return strip_field(data, MODULE_ID)


@dataclass(frozen=True)
class HloShape:
    """An array shape (dtype, dims) or a tuple of shapes."""

    dtype: str
    dims: tuple[int, ...] = ()
    elements: tuple[HloShape, ...] = ()

    def __str__(self) -> str:
        if self.dtype == "tuple":
            return "(" + ", ".join(str(e) for e in self.elements) + ")"
        return f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class HloModuleSummary:
    """What a consumer of the module relies on: entry signature, root kind and the opcodes used."""

    name: str
    entry: str
    parameters: tuple[HloShape, ...]
    result: HloShape
    root_opcode: str
    opcodes: tuple[tuple[str, int], ...]  # (opcode, count) over every computation, sorted
    computations: int


def _submessages(data: bytes, number: int) -> list[bytes]:
    return [v for f, w, v, _s, _e in iter_fields(data) if f == number and w == 2 and isinstance(v, bytes)]


def _scalar(data: bytes, number: int, default: int = 0) -> int:
    found = [v for f, w, v, _s, _e in iter_fields(data) if f == number and w == 0 and isinstance(v, int)]
    return found[-1] if found else default


def _string(data: bytes, number: int) -> str:
    found = _submessages(data, number)
    try:
        return found[-1].decode("utf-8") if found else ""
    except UnicodeDecodeError:
        raise ProtoError(f"field {number} is not a UTF-8 string") from None


def _packed_ints(data: bytes, number: int) -> tuple[int, ...]:
    values: list[int] = []
    for f, w, v, _s, _e in iter_fields(data):
        if f != number:
            continue
        if w == 0 and isinstance(v, int):
            values.append(v)
        elif w == 2 and isinstance(v, bytes):
            i = 0
            while i < len(v):
                n, i = _varint(v, i)
                values.append(n)
        else:
            raise ProtoError(f"field {number}: expected integers")
    return tuple(values)


def parse_shape(data: bytes) -> HloShape:
    code = _scalar(data, SHAPE_ELEMENT_TYPE)
    dtype = ELEMENT_TYPES.get(code)
    if dtype is None:
        raise ProtoError(f"unknown element type {code}")
    if dtype == "tuple":
        return HloShape("tuple", (), tuple(parse_shape(s) for s in _submessages(data, SHAPE_TUPLE_SHAPES)))
    return HloShape(dtype, _packed_ints(data, SHAPE_DIMENSIONS))


def parse_hlo_module(data: bytes) -> HloModuleSummary:
    """Decode and check the structure of a serialized HloModuleProto; ProtoError when it is something else.

    Checked: every level parses as protobuf; the module has a name, computations and a host program shape; the entry
    computation (by id) exists and has its root instruction; each entry parameter number 0..n-1 appears once with the
    shape the program shape declares; every instruction has an opcode."""
    if not data:
        raise ProtoError("empty file")
    name = _string(data, MODULE_NAME)
    entry_name = _string(data, MODULE_ENTRY_NAME)
    comps = _submessages(data, MODULE_COMPUTATIONS)
    host = _submessages(data, MODULE_HOST_SHAPE)
    if not name or not comps or not host:
        raise ProtoError("not an HloModuleProto (no name, computations or host program shape)")
    entry_id = _scalar(data, MODULE_ENTRY_ID, default=-1)
    params = tuple(parse_shape(s) for s in _submessages(host[-1], PROGRAM_SHAPE_PARAMETERS))
    results = _submessages(host[-1], PROGRAM_SHAPE_RESULT)
    if not results:
        raise ProtoError("host program shape has no result")
    result = parse_shape(results[-1])
    opcodes: collections.Counter[str] = collections.Counter()
    entry_root = ""
    found_entry = False
    for comp in comps:
        comp_id = _scalar(comp, COMP_ID, default=-1)
        root_id = _scalar(comp, COMP_ROOT_ID, default=-1)
        is_entry = comp_id == entry_id
        found_entry |= is_entry
        entry_params: dict[int, HloShape] = {}
        root = ""
        for instr in _submessages(comp, COMP_INSTRUCTIONS):
            opcode = _string(instr, INSTR_OPCODE)
            if not opcode:
                raise ProtoError(f"instruction {_string(instr, INSTR_NAME)!r} has no opcode")
            opcodes[opcode] += 1
            if _scalar(instr, INSTR_ID, default=-1) == root_id:
                root = opcode
            if is_entry and opcode == "parameter":
                number = _scalar(instr, INSTR_PARAMETER_NUMBER)
                if number in entry_params:
                    raise ProtoError(f"entry parameter {number} appears twice")
                shapes = _submessages(instr, INSTR_SHAPE)
                entry_params[number] = parse_shape(shapes[-1]) if shapes else HloShape("token")
        if not root:
            raise ProtoError(f"computation {_string(comp, COMP_NAME)!r} has no root instruction")
        if is_entry:
            entry_root = root
            if sorted(entry_params) != list(range(len(params))):
                raise ProtoError(f"entry parameters {sorted(entry_params)} do not match the program shape's "
                                 f"{len(params)}")
            for number, shape in entry_params.items():
                if shape != params[number]:
                    raise ProtoError(f"entry parameter {number} is {shape}, the program shape says {params[number]}")
    if not found_entry:
        raise ProtoError(f"entry computation id {entry_id} not found")
    return HloModuleSummary(name, entry_name, params, result, entry_root, tuple(sorted(opcodes.items())), len(comps))
