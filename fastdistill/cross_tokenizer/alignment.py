"""Aligning one completion across two tokenizers: token bytes, byte spans, aligned groups, the teacher's rendering.

A teacher with another tokenizer scores the student's completion **text**, re-tokenized its own way. The two
tokenizations cover the same UTF-8 bytes, so each token has a byte span ``[start, end)`` into the text, and the
positions where both tokenizers put a token boundary cut the completion into **aligned groups**: one or more student
tokens whose bytes are exactly those of one or more teacher tokens ("hello" ↔ "hel" + "lo"; a 4-byte emoji split
2 + 2 on one side and 1 + 3 on the other is one group). A group's first student token and first teacher token are
predicted from the same text prefix, which is what the cross-tokenizer losses compare.

- :class:`TokenizerBytes`: a tokenizer's bytes per id (``None`` for special tokens), read once.
- :func:`student_completion_spans`: the student's completion ids → their text and byte spans (special tokens carry
  no bytes and are excluded).
- :func:`byte_offsets_from_char_offsets`: a fast tokenizer's character offsets → byte offsets.
- :func:`align_byte_spans`: two span arrays → :class:`Alignment` (the group of each token on each side).
- :func:`render_teacher_sequence`: the teacher's prompt ids (its own chat template, same conversation), its
  tokenization of the completion text and the alignment, or an :class:`~fastdistill.errors.AlignmentError`.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM, …) and SentencePiece-style ones (``▁`` for a space,
``<0xNN>`` byte-fallback pieces: Llama 2, Mistral, Gemma) have exact bytes per token. Other tokenizers fall back to
decoding each token alone, which is exact for pieces that decode to whole characters; where it is not, the
byte-for-byte round-trip check refuses the completion with an :class:`AlignmentError` rather than align it wrongly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from fastdistill.errors import AlignmentError


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character table, inverted: the character a byte-level piece uses → the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and ("ByteLevel" in repr(backend.decoder) or "ByteLevel" in repr(backend.pre_tokenizer))


_METASPACE = "\u2581"  # SentencePiece's word-boundary marker: a space
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _uses_metaspace(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and any("Metaspace" in repr(part) or _METASPACE in repr(part)
                                       for part in (backend.decoder, backend.pre_tokenizer, backend.normalizer))


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


@dataclass(frozen=True)
class TokenizerBytes:
    """A tokenizer's UTF-8 bytes per token id, read once (O(V)) and reused for every completion.

    Attributes:
        tokenizer: the Hugging Face tokenizer (fast) it was read from.
        pieces: ``len(tokenizer)`` entries: the token's bytes, or None for a special token (chat markers, eos, pad)
            and for a token whose bytes cannot be read.
        byte_level: whether the bytes are exact (a byte-level BPE) rather than decoded one token at a time.
        prefix_space: a SentencePiece-style tokenizer (``▁`` for spaces, ``<0xNN>`` byte fallback): its bytes are
            exact too, and it may put a space before the text it encodes (its first ``▁``), which
            :func:`teacher_completion_ids` takes off.
        lengths: int64 ``(len(tokenizer),)``, the bytes per id (0 where ``pieces`` is None).
    """

    tokenizer: Any
    pieces: tuple[bytes | None, ...]
    byte_level: bool
    prefix_space: bool
    lengths: np.ndarray = field(repr=False)
    _joinable: np.ndarray = field(repr=False)  # object array: the bytes, b"" for None (for one vectorised join)

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerBytes:
        """Read ``tokenizer``'s bytes per id (a Hugging Face fast tokenizer; ``len(tokenizer)`` ids)."""
        size = len(tokenizer)
        special = _special_ids(tokenizer)
        byte_level = _is_byte_level(tokenizer)
        metaspace = not byte_level and _uses_metaspace(tokenizer)
        pieces: list[bytes | None] = []
        tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
        decoder = byte_level_decoder()
        added = {int(i): t for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        for token_id, token in enumerate(tokens):
            if token_id in special or token is None:
                pieces.append(None)
            elif token_id in added:  # an added token's content is its text, not a byte-level piece
                pieces.append(str(added[token_id]).encode("utf-8"))
            elif byte_level:
                try:
                    pieces.append(bytes(decoder[ch] for ch in token))
                except KeyError:
                    pieces.append(None)
            elif metaspace:
                byte = _BYTE_FALLBACK.fullmatch(token)
                pieces.append(bytes([int(byte.group(1), 16)]) if byte else token.replace(_METASPACE, " ").encode())
            else:
                text = tokenizer.convert_tokens_to_string([token])
                pieces.append(None if "\ufffd" in text else text.encode("utf-8"))
        lengths = np.fromiter((len(p) if p else 0 for p in pieces), dtype=np.int64, count=size)
        joinable = np.empty(size, dtype=object)
        joinable[:] = [p or b"" for p in pieces]
        return cls(tokenizer=tokenizer, pieces=tuple(pieces), byte_level=byte_level, prefix_space=metaspace,
                   lengths=lengths, _joinable=joinable)

    def _checked(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(self.pieces)):
            bad = int(ids[(ids < 0) | (ids >= len(self.pieces))][0])
            raise ValueError(f"token id {bad} is outside the tokenizer's {len(self.pieces)} ids")
        return ids

    def token_bytes(self, ids: Sequence[int] | np.ndarray) -> list[bytes | None]:
        """The bytes of each id (None: special or unreadable); an id outside ``[0, len(pieces))`` raises ValueError."""
        return [self.pieces[i] for i in self._checked(ids).tolist()]

    def spans(self, ids: Sequence[int] | np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
        """:func:`spans_from_token_bytes` of ``ids``' bytes, vectorised: ``(text_bytes, spans (n, 2), included)``."""
        ids = self._checked(ids)
        lengths = self.lengths[ids]
        return b"".join(self._joinable[ids].tolist()), _spans_of_lengths(lengths), lengths > 0


def _spans_of_lengths(lengths: np.ndarray) -> np.ndarray:
    ends = np.cumsum(lengths)
    spans = np.stack([ends - lengths, ends], axis=1)
    spans[lengths == 0] = -1
    return spans


def spans_from_token_bytes(pieces: Sequence[bytes | None]) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Concatenate token bytes into the text they spell and give each token its byte span.

    Args:
        pieces: per token, its bytes, or None for a token that carries none (a special token): excluded.

    Returns:
        ``(text_bytes, spans, included)``: the bytes, int64 ``(n, 2)`` ``[start, end)`` per token (``(-1, -1)`` for
        excluded ones) and the ``(n,)`` bool mask of included tokens (those with at least one byte; an empty piece is
        excluded like a special token).
    """
    lengths = np.fromiter((0 if p is None else len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    return b"".join(p for p in pieces if p), _spans_of_lengths(lengths), lengths > 0


def byte_offsets_from_char_offsets(text: str, char_offsets: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """Character offsets into ``text`` (a fast tokenizer's ``offset_mapping``) → UTF-8 byte offsets, int64 ``(n, 2)``.

    Exact for tokens that hold whole characters. A byte-level tokenizer that splits one multi-byte character over
    several tokens gives them all that character's span: such overlapping spans are not a tokenization of the bytes,
    and :func:`align_byte_spans` refuses them (take the spans from the token bytes instead,
    :func:`spans_from_token_bytes`).
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
    char_to_byte = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
    offsets = np.asarray(char_offsets, dtype=np.int64).reshape(-1, 2)
    if offsets.size and (offsets.min() < 0 or offsets.max() > len(codes)):
        raise ValueError(f"character offsets must lie in [0, {len(codes)}] for a text of {len(codes)} characters")
    return char_to_byte[offsets]


@dataclass(frozen=True)
class Alignment:
    """The aligned groups of one completion. ``G`` groups, ``Ls`` student and ``Lt`` teacher completion tokens.

    Attributes:
        student_group: int32 ``(Ls,)``, the group of each student token, -1 for excluded tokens (special tokens).
        teacher_group: int32 ``(Lt,)``, the same for the teacher's tokens.
        num_groups: G. Groups are numbered in text order; each holds ≥ 1 token on each side, contiguous.
    """

    student_group: np.ndarray
    teacher_group: np.ndarray
    num_groups: int

    @property
    def student_first(self) -> np.ndarray:
        """int64 ``(G,)``, the position of each group's first student token."""
        return _first_positions(self.student_group, self.num_groups)

    @property
    def teacher_first(self) -> np.ndarray:
        """int64 ``(G,)``, the position of each group's first teacher token."""
        return _first_positions(self.teacher_group, self.num_groups)


def _first_positions(group: np.ndarray, num_groups: int) -> np.ndarray:
    positions = np.nonzero(group >= 0)[0]
    first = np.full(num_groups, -1, dtype=np.int64)
    # positions ascend, so writing them in reverse leaves each group's smallest position
    first[group[positions[::-1]]] = positions[::-1]
    return first


def _check_tiling(spans: np.ndarray, included: np.ndarray, side: str) -> np.ndarray:
    """The ends of the included spans, after checking they tile ``[0, end)`` in order with no gap or overlap."""
    kept = spans[included]
    if kept.shape[0] == 0:
        return kept[:, 1]
    starts, ends = kept[:, 0], kept[:, 1]
    bad = np.concatenate([[starts[0] != 0], starts[1:] != ends[:-1]]) | (ends <= starts)
    if bool(bad.any()):
        first = int(np.argmax(bad))
        before = kept[first - 1].tolist() if first else "none"
        raise AlignmentError(f"the {side} byte spans do not tile the completion's bytes in order (included token "
                             f"{first}: {kept[first].tolist()}, after {before}): "
                             "each included token needs ≥ 1 byte and consecutive spans must meet; a character split "
                             "over tokens needs spans from the token bytes, not from character offsets")
    return ends


def align_byte_spans(student_spans: np.ndarray, student_included: np.ndarray, teacher_spans: np.ndarray,
                     teacher_included: np.ndarray) -> Alignment:
    """Group two tokenizations of the same bytes at the boundaries they share.

    Args:
        student_spans, teacher_spans: int64 ``(Ls, 2)`` / ``(Lt, 2)`` byte spans ``[start, end)`` per token.
        student_included, teacher_included: bool ``(Ls,)`` / ``(Lt,)``, the tokens that take part (False for special
            tokens; their spans are ignored).

    Returns:
        :class:`Alignment`. A token belongs to the group that ends at the first shared boundary at or after its end.

    Raises:
        AlignmentError: the included spans do not tile the bytes in order, or the two sides cover different lengths.
    """
    s_ends = _check_tiling(np.asarray(student_spans), np.asarray(student_included, bool), "student")
    t_ends = _check_tiling(np.asarray(teacher_spans), np.asarray(teacher_included, bool), "teacher")
    s_total = int(s_ends[-1]) if s_ends.size else 0
    t_total = int(t_ends[-1]) if t_ends.size else 0
    if s_total != t_total:
        raise AlignmentError(f"the student's tokens cover {s_total} bytes and the teacher's {t_total}: they are not "
                             "two tokenizations of the same text")
    shared = np.intersect1d(s_ends, t_ends, assume_unique=True)  # ascending; ends are strictly increasing

    def groups(ends: np.ndarray, included: np.ndarray) -> np.ndarray:
        out = np.full(included.shape[0], -1, dtype=np.int32)
        out[included] = np.searchsorted(shared, ends)
        return out

    return Alignment(student_group=groups(s_ends, np.asarray(student_included, bool)),
                     teacher_group=groups(t_ends, np.asarray(teacher_included, bool)),
                     num_groups=int(shared.shape[0]))


@dataclass(frozen=True)
class StudentCompletion:
    """The student's completion as text: ``text`` (its non-special tokens' bytes, decoded), ``spans`` int64
    ``(Ls, 2)`` and ``included`` bool ``(Ls,)`` as :func:`spans_from_token_bytes` gives them."""

    text: str
    spans: np.ndarray
    included: np.ndarray


def student_completion_spans(student: TokenizerBytes, completion_ids: Sequence[int] | np.ndarray) -> StudentCompletion:
    """The student's completion ids → :class:`StudentCompletion` (special tokens excluded, e.g. the trailing eos).

    Raises:
        AlignmentError: the tokens' bytes are not valid UTF-8 (e.g. a completion cut inside a multi-byte character).
    """
    raw, spans, included = student.spans(completion_ids)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise AlignmentError(f"the student's completion is not valid UTF-8 at byte {err.start} of {len(raw)} (a "
                             "completion cut inside a multi-byte character, or stray byte tokens): there is no text "
                             "to give the teacher") from err
    return StudentCompletion(text=text, spans=spans, included=included)


def teacher_prompt_ids(teacher_tokenizer: Any, messages: Sequence[Mapping[str, Any]] | str,
                       chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The teacher's prompt: ``messages`` (the conversation before the assistant turn) rendered by the teacher's own
    chat template with the generation prompt, as ids; a string prompt is tokenized as it is (no template, no special
    tokens), as the student's string prompts are."""
    if isinstance(messages, str):
        return [int(i) for i in teacher_tokenizer(messages, add_special_tokens=False)["input_ids"]]
    ids = teacher_tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                return_dict=False, **dict(chat_template_kwargs or {}))
    return [int(i) for i in ids]


def teacher_completion_ids(teacher: TokenizerBytes, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The teacher's tokenization of the completion ``text``: ``(ids int32 (Lt,), spans int64 (Lt, 2), included
    bool (Lt,))``, spans from the teacher's token bytes.

    Raises:
        AlignmentError: the teacher's tokens do not spell ``text`` byte for byte (a normaliser, an unknown-token
            fallback, the text of a special token inside the completion, a non-byte-level piece that does not decode
            to itself).
    """
    ids = np.asarray(teacher.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
    raw, spans, included = teacher.spans(ids)
    want = text.encode("utf-8")
    special = any(teacher.pieces[i] is None for i in ids.tolist())
    if raw != want and teacher.prefix_space and raw == b" " + want and included.any():
        raw, spans, included = raw[1:], spans - included[:, None], included.copy()  # the space it put in front
        first = int(np.argmax(included))
        spans[first, 0] = 0
        if spans[first, 1] == 0:  # a lone "▁" token: no byte of the text left
            spans[first], included[first] = -1, False
    if raw != want or special:
        where = next((i for i, (a, b) in enumerate(zip(raw, want, strict=False)) if a != b), min(len(raw), len(want)))
        raise AlignmentError(f"the teacher's tokenizer does not round-trip the completion: its tokens spell "
                             f"{len(raw)} bytes against the text's {len(want)}, first differing at byte {where} "
                             f"(text around it: {want[max(0, where - 12):where + 12]!r})"
                             + ("; it produced special tokens" if special else ""))
    return ids, spans, included


@dataclass(frozen=True)
class TeacherSequence:
    """What the teacher scores for one rollout, and how it lines up with the student's tokens.

    Attributes:
        prompt_ids: the teacher's prompt (its chat template, the same conversation).
        completion_ids: int32 ``(Lt,)``, the teacher's tokens of the completion text (no special tokens).
        text: the completion text (the student's completion without its special tokens).
        alignment: the student's completion tokens ↔ ``completion_ids``.
    """

    prompt_ids: list[int]
    completion_ids: np.ndarray
    text: str
    alignment: Alignment

    @property
    def input_ids(self) -> list[int]:
        """The full sequence the teacher scores: prompt ids then completion ids."""
        return self.prompt_ids + self.completion_ids.tolist()


def render_teacher_sequence(student: TokenizerBytes, teacher: TokenizerBytes,
                            messages: Sequence[Mapping[str, Any]] | str,
                            completion_ids: Sequence[int] | np.ndarray, *,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> TeacherSequence:
    """Re-render one rollout for a teacher with another tokenizer: the teacher's prompt from its own chat template
    for ``messages`` (a string prompt: tokenized as it is), the student's completion (``completion_ids``, special
    tokens dropped) as text tokenized by the teacher, and the alignment of the two completions. A pure function of
    the two tokenizers.

    Raises:
        AlignmentError: the completion is not valid UTF-8 or the teacher does not round-trip its text.
    """
    completion = student_completion_spans(student, completion_ids)
    ids, spans, included = teacher_completion_ids(teacher, completion.text)
    alignment = align_byte_spans(completion.spans, completion.included, spans, included)
    return TeacherSequence(prompt_ids=teacher_prompt_ids(teacher.tokenizer, messages, chat_template_kwargs),
                           completion_ids=ids, text=completion.text, alignment=alignment)
