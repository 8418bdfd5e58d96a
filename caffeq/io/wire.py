"""Protobuf wire-format encoding shared by the hand-rolled writers.

The .caffemodel reader/writer and the ONNX writer emit some messages in wire
format by hand (to stream large float payloads without building protobuf
lists); these helpers are the one place that encodes keys and lengths.
"""

# Wire types
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


def encode_varint(value):
    """Base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_key(number, wire):
    """Field key: field number and wire type."""
    return encode_varint((number << 3) | wire)


def len_field(number, payload_len):
    """Key and length prefix of a length-delimited field (the payload follows)."""
    return encode_key(number, LEN) + encode_varint(payload_len)
