"""One reusable msgpack encoder/decoder pair per message type (msgspec's advice)."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class Codec(Generic[T]):
    def __init__(self, type_: type[T]) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)

    @staticmethod
    def encode(message: object) -> bytes:
        return _encoder.encode(message)
