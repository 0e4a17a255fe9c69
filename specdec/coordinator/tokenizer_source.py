"""The coordinator's tokenizer: what it encodes text prompts and stop strings
with and decodes deltas to text with. It must be the target's own: a
directory given with ``--tokenizer`` (checked against the target's vocabulary
fingerprint), or by default the files the target service serves
(``GetTokenizer``), fetched when the pair is first checked and again whenever
the target's vocabulary changes. ``--tokenizer none``: no tokenizer, only
``prompt_ids`` requests.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import tempfile

import grpc

from specdec.serving import convert as conv

log = logging.getLogger("specdec.coordinator")


class TokenizerSource:
    """The tokenizer for the pair in service (see the module docstring)."""

    def __init__(self, directory: pathlib.Path | None = None, from_target: bool = False, tokenizer=None):
        from specdec.models.tokenizer import load_tokenizer

        self.from_target = from_target
        self.directory = directory
        self.tokenizer = load_tokenizer(directory) if directory is not None else tokenizer
        self._fingerprint: str | None = None  # the vocabulary the fetched tokenizer is the target's of
        self._lock = asyncio.Lock()
        self._files: tempfile.TemporaryDirectory | None = None

    @classmethod
    def for_config(cls, config) -> TokenizerSource:
        """From ``--tokenizer``: a directory (checked), ``none``, or unset (the target's)."""
        from specdec.models.tokenizer import has_tokenizer

        if config.tokenizer == "none":
            return cls()
        if not config.tokenizer:
            return cls(from_target=True)
        path = pathlib.Path(config.tokenizer)
        if not path.is_dir():
            raise ValueError(f"--tokenizer {path}: not a directory")
        if not has_tokenizer(path):
            raise ValueError(f"--tokenizer {path}: no tokenizer.json or tokenizer_config.json in it")
        return cls(path)

    async def for_pair(self, fingerprint: str, target) -> object | None:
        """The tokenizer to use with a target whose vocabulary fingerprint is
        ``fingerprint``; fetched from ``target`` (a ServiceClient) when it must be."""
        if not self.from_target or fingerprint == self._fingerprint:
            return self.tokenizer
        async with self._lock:
            if fingerprint != self._fingerprint:
                self.tokenizer = await self._fetch(target)
                self._fingerprint = fingerprint
        return self.tokenizer

    async def _fetch(self, target):
        from specdec.models.tokenizer import TOKENIZER_FILES, load_tokenizer

        files: dict[str, bytearray] = {}
        try:
            async for chunk in target.stub.GetTokenizer(conv.tokenizer_request(), timeout=target.info_timeout_s):
                name, data = conv.tokenizer_file_from_proto(chunk)
                if name in TOKENIZER_FILES:  # a known file name, never a path
                    files.setdefault(name, bytearray()).extend(data)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                log.warning("the target at %s serves no tokenizer (%s): only prompt_ids requests work, deltas carry "
                            "no text; give --tokenizer DIR", target.address, e.details())
                return None
            raise target.translate(e, "GetTokenizer") from None
        self.close()
        self._files = tempfile.TemporaryDirectory(prefix="specdec-tokenizer-")
        where = pathlib.Path(self._files.name)
        for name, data in files.items():
            (where / name).write_bytes(bytes(data))
        tokenizer = await asyncio.to_thread(load_tokenizer, where)  # not on the event loop: it takes a while
        log.info("tokenizer from the target at %s (%d files, vocabulary of %d)", target.address, len(files),
                 len(tokenizer) if tokenizer is not None else 0)
        return tokenizer

    def close(self) -> None:
        if self._files is not None:
            self._files.cleanup()
            self._files = None
