"""Cross-tokenizer alignment, the vocabulary map and the per-student-position targets, against hand-built cases,
TRL GOLD's byte-offset aligner and byte-for-byte checks on two tokenizers with different vocabularies."""

from __future__ import annotations

import numpy as np
import pytest

from fastdistill.cross_tokenizer import (
    Alignment,
    TokenizerBytes,
    VocabularyMap,
    align_byte_spans,
    build_targets,
    byte_offsets_from_char_offsets,
    concatenate_targets,
    realised_logprobs,
    render_teacher_sequence,
    spans_from_token_bytes,
    student_completion_spans,
    teacher_completion_ids,
    teacher_prompt_ids,
)
from fastdistill.cross_tokenizer.targets import _merge_same_ids
from fastdistill.errors import AlignmentError
from fastdistill_testing.cross_tokenizer_samples import (
    TEXTS,
    lossy_tokenizer,
    sentencepiece_tokenizer,
    student_tokenizer,
    teacher_tokenizer,
)

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def student():
    return TokenizerBytes.of(student_tokenizer())


@pytest.fixture(scope="module")
def teacher():
    return TokenizerBytes.of(teacher_tokenizer())


def align_pieces(student_pieces, teacher_pieces) -> Alignment:
    _, s_spans, s_in = spans_from_token_bytes(student_pieces)
    _, t_spans, t_in = spans_from_token_bytes(teacher_pieces)
    return align_byte_spans(s_spans, s_in, t_spans, t_in)


@pytest.mark.parametrize("student_pieces, teacher_pieces, student_groups, teacher_groups", [
    # a merge on the teacher's side: "he" + "llo" ↔ "hello"
    ([b"he", b"llo", b" world"], [b"hello", b" world"], [0, 0, 1], [0, 1]),
    # a split on the teacher's side, then 1 : 1
    ([b" the", b" cat"], [b" ", b"the", b" cat"], [0, 1], [0, 0, 1]),
    # boundaries that never meet until the end: "a|bc|d" ↔ "ab|cd"
    ([b"a", b"bc", b"d"], [b"ab", b"cd"], [0, 0, 0], [0, 0]),
    # whitespace runs and newlines tokenized differently
    ([b"x", b"\n\n", b"  ", b"y"], [b"x", b"\n", b"\n  ", b"y"], [0, 1, 1, 2], [0, 1, 1, 2]),
    # a 4-byte emoji (F0 9F 99 82) split 2+2 on one side and 1+3 on the other, then an accented é split 1+1 vs whole
    ([b"\xf0\x9f", b"\x99\x82", b"\xc3", b"\xa9"], [b"\xf0", b"\x9f\x99\x82", b"\xc3\xa9"], [0, 0, 1, 1], [0, 0, 1]),
    # special tokens (None) on either side are excluded, wherever they sit
    ([None, b"ab", None, b"c", None], [b"a", b"b", b"c"], [-1, 0, -1, 1, -1], [0, 0, 1]),
])
def test_hand_built_alignments(student_pieces, teacher_pieces, student_groups, teacher_groups):
    alignment = align_pieces(student_pieces, teacher_pieces)
    assert alignment.student_group.tolist() == student_groups
    assert alignment.teacher_group.tolist() == teacher_groups
    assert alignment.num_groups == max(student_groups) + 1
    # every group spells the same bytes on both sides
    for g in range(alignment.num_groups):
        s = b"".join(p for p, k in zip(student_pieces, student_groups, strict=True) if k == g)
        t = b"".join(p for p, k in zip(teacher_pieces, teacher_groups, strict=True) if k == g)
        assert s == t and s


def test_first_positions_skip_excluded_tokens():
    alignment = align_pieces([None, b"ab", b"c", None, b"d"], [b"a", b"bc", b"d"])
    assert alignment.student_group.tolist() == [-1, 0, 0, -1, 1]
    assert alignment.student_first.tolist() == [1, 4]
    assert alignment.teacher_first.tolist() == [0, 2]


def test_alignment_refuses_spans_that_do_not_tile():
    spans = np.array([[0, 2], [2, 5]])
    ok = np.ones(2, bool)
    with pytest.raises(AlignmentError, match="cover 5 bytes and the teacher's 4"):
        align_byte_spans(spans, ok, np.array([[0, 4]]), np.ones(1, bool))
    with pytest.raises(AlignmentError, match="do not tile"):  # a gap
        align_byte_spans(spans, ok, np.array([[0, 2], [3, 5]]), ok)
    with pytest.raises(AlignmentError, match="do not tile"):  # an overlap
        align_byte_spans(np.array([[0, 3], [2, 5]]), ok, spans, ok)


def test_char_offsets_to_byte_offsets():
    text = "aé🙂b"  # 1 + 2 + 4 + 1 bytes
    assert byte_offsets_from_char_offsets(text, [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)]).tolist() == [
        [0, 1], [1, 3], [3, 7], [7, 8], [0, 8]]
    with pytest.raises(ValueError, match="must lie in"):
        byte_offsets_from_char_offsets(text, [(0, 5)])


def test_char_offsets_of_a_split_character_are_refused_and_token_bytes_are_not(student, teacher):
    text = "ok 🙂"
    enc = student.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces = student.token_bytes(enc["input_ids"])
    assert sum(1 for p in pieces if p and p[0] >= 0x80) > 1, "the emoji should be split over byte tokens"
    from_chars = byte_offsets_from_char_offsets(text, enc["offset_mapping"])
    ids, t_spans, t_in = teacher_completion_ids(teacher, text)
    with pytest.raises(AlignmentError, match="character offsets"):
        align_byte_spans(from_chars, np.ones(len(pieces), bool), t_spans, t_in)
    _, spans, included = spans_from_token_bytes(pieces)
    assert align_byte_spans(spans, included, t_spans, t_in).num_groups >= 2


def test_char_offsets_agree_with_token_bytes_without_split_characters(student):
    text = "The quick brown fox, jumps over\n  the lazy dog."
    enc = student.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    _, spans, _ = spans_from_token_bytes(student.token_bytes(enc["input_ids"]))
    assert byte_offsets_from_char_offsets(text, enc["offset_mapping"]).tolist() == spans.tolist()


def test_token_bytes_of_the_tiny_tokenizers(student, teacher):
    assert student.byte_level and teacher.byte_level
    for tb in (student, teacher):
        tok = tb.tokenizer
        special = set(tok.all_special_ids) | {i for i, a in tok.added_tokens_decoder.items() if a.special}
        assert {i for i, p in enumerate(tb.pieces) if p is None} == special
        for text in TEXTS:  # concatenated token bytes spell the text exactly
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert b"".join(tb.token_bytes(ids)) == text.encode()
            raw, spans, included = tb.spans(ids + [tok.eos_token_id])  # the vectorised path, a special included
            want = spans_from_token_bytes(tb.token_bytes(ids + [tok.eos_token_id]))
            assert raw == want[0] and spans.tolist() == want[1].tolist() and included.tolist() == want[2].tolist()
    with pytest.raises(ValueError, match="outside the tokenizer"):
        student.token_bytes([len(student.pieces)])
    with pytest.raises(ValueError, match="token id -1 is outside"):
        student.spans([3, -1])


@pytest.mark.parametrize("text", TEXTS)
def test_render_teacher_sequence_on_two_real_tokenizers(student, teacher, text):
    from trl.experimental.gold.gold_trainer import ULDLoss

    s_ids = student.tokenizer(text, add_special_tokens=False)["input_ids"] + [student.tokenizer.eos_token_id]
    seq = render_teacher_sequence(student, teacher, MESSAGES, s_ids)
    assert seq.text == text
    assert seq.completion_ids.tolist() == teacher.tokenizer(text, add_special_tokens=False)["input_ids"]
    rendered = teacher.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert teacher.tokenizer.decode(seq.input_ids) == rendered + text
    assert seq.prompt_ids == teacher_prompt_ids(teacher.tokenizer, MESSAGES)
    a = seq.alignment
    assert a.student_group[-1] == -1 and (a.student_group[:-1] >= 0).all()  # the eos is excluded
    # the same groups as GOLD's byte-offset walk on the same spans
    s_spans = student_completion_spans(student, s_ids).spans[:-1].tolist()
    _, t_spans, _ = teacher_completion_ids(teacher, text)
    gold_s, gold_t = ULDLoss._align_by_byte_offsets(s_spans, t_spans.tolist())
    assert [np.nonzero(a.student_group == g)[0].tolist() for g in range(a.num_groups)] == gold_s
    assert [np.nonzero(a.teacher_group == g)[0].tolist() for g in range(a.num_groups)] == gold_t
    s_pieces, t_pieces = student.token_bytes(s_ids), teacher.token_bytes(seq.completion_ids)
    for g in range(a.num_groups):
        assert (b"".join(s_pieces[i] for i in gold_s[g]) == b"".join(t_pieces[i] for i in gold_t[g]))


def test_the_student_special_tokens_are_dropped_from_the_text(student, teacher):
    tok = student.tokenizer
    ids = tok("Hello", add_special_tokens=False)["input_ids"] + [1] + tok(" there", add_special_tokens=False)[
        "input_ids"] + [tok.eos_token_id]
    seq = render_teacher_sequence(student, teacher, MESSAGES, ids)
    assert seq.text == "Hello there"
    assert seq.alignment.student_group[[len(ids) - 1]].tolist() == [-1]
    assert (seq.alignment.student_group == -1).sum() == 2


def test_text_the_teacher_cannot_round_trip_is_an_alignment_error(student):
    lossy = TokenizerBytes.of(lossy_tokenizer())
    assert not lossy.byte_level
    ids = student.tokenizer("the quick fox", add_special_tokens=False)["input_ids"]
    assert render_teacher_sequence(student, lossy, MESSAGES, ids).text == "the quick fox"  # round-trips
    for text in ("The Quick fox", "the 🙂 fox"):  # lowercased; an unknown character
        ids = student.tokenizer(text, add_special_tokens=False)["input_ids"]
        with pytest.raises(AlignmentError, match="does not round-trip"):
            render_teacher_sequence(student, lossy, MESSAGES, ids)


def test_special_token_text_inside_the_completion_is_an_alignment_error(student, teacher):
    # the student spelled "<end_of_turn>" with ordinary tokens; the teacher parses it as its special token
    ids = student.tokenizer("a<end_of_turn>b", add_special_tokens=False)["input_ids"]
    with pytest.raises(AlignmentError, match="special tokens"):
        render_teacher_sequence(student, teacher, MESSAGES, ids)


def test_a_completion_cut_inside_a_character_is_an_alignment_error(student, teacher):
    ids = student.tokenizer("ok 🙂", add_special_tokens=False)["input_ids"]
    with pytest.raises(AlignmentError, match="not valid UTF-8"):
        render_teacher_sequence(student, teacher, MESSAGES, ids[:-1])


def test_vocabulary_map_pairs_tokens_with_the_same_bytes(student, teacher):
    vocab = VocabularyMap.from_token_bytes(student, teacher, student_vocab_size=416)
    assert vocab.student_vocab_size == 416 and vocab.teacher_vocab_size == len(teacher.pieces)
    # independent oracle: two byte-level tokenizers pair exactly the equal piece strings, special tokens aside
    s_vocab = {p: i for p, i in student.tokenizer.get_vocab().items() if student.pieces[i] is not None}
    expected = {i: s_vocab[p] for p, i in teacher.tokenizer.get_vocab().items()
                if p in s_vocab and teacher.pieces[i] is not None}
    got = {u: int(v) for u, v in enumerate(vocab.teacher_to_student) if v >= 0}
    assert got == expected and vocab.num_shared == len(expected) > 256
    assert set(np.nonzero(vocab.student_shared)[0].tolist()) == set(expected.values())
    assert not vocab.student_shared[len(student.pieces):].any()
    assert vocab.gold_weights() == pytest.approx((len(expected) / 380, 1 - len(expected) / 380))
    empty = VocabularyMap.empty(409, 380)
    assert empty.num_shared == 0 and empty.gold_weights() == (0.0, 1.0)
    with pytest.raises(ValueError, match="at least the tokenizers' lengths"):
        VocabularyMap.from_token_bytes(student, teacher, student_vocab_size=100)


def hand_built_targets():
    """Student "ab" "c" "d" <eos>; teacher "a" "b" "cd": groups {ab ↔ a b}, {c d ↔ cd}."""
    alignment = align_pieces([b"ab", b"c", b"d", None], [b"a", b"b", b"cd"])
    # teacher ids 0..5; map: 0→10, 1→11, 2→10 (same bytes as 0), others unshared
    vocab = VocabularyMap(teacher_to_student=np.array([10, 11, 10, -1, -1, -1], np.int32),
                          student_shared=np.isin(np.arange(16), [10, 11]))
    teacher_ids = np.array([3, 1, 4])
    cand = np.array([[0, 2, 4, 3], [1, 5, 0, -1], [5, 4, 3, -1]])  # top-3 then the realised token when outside
    probs = np.array([[0.4, 0.2, 0.1, 0.05], [0.5, 0.3, 0.1, 1.0], [0.6, 0.3, 0.05, 1.0]])
    lps = np.where(cand >= 0, np.log(probs), -np.inf)
    return alignment, vocab, teacher_ids, cand, lps.astype(np.float32)


def test_build_targets_by_hand():
    alignment, vocab, teacher_ids, cand, lps = hand_built_targets()
    t = build_targets(alignment, teacher_ids, cand, lps, vocab, top_k=3)
    assert t.group_index.tolist() == [0, 1, 1, -1] and t.group_start.tolist() == [True, True, False, False]
    assert t.num_groups == 2
    # group 0 starts at teacher token 0: ids 0 and 2 both map to student 10 → one slot holding 0.4 + 0.2
    assert t.shared_ids[0].tolist() == [10, -1, -1, -1]
    np.testing.assert_allclose(np.exp(t.shared_logprobs[0]), [0.6, 0, 0, 0], atol=1e-7)
    # ranked unshared: teacher 4 (0.1); the realised token 3 (slot 3, outside the top-3) is not ranked
    np.testing.assert_allclose(np.exp(t.unshared_logprobs[0]), [0.1, 0, 0], atol=1e-7)
    # group 1 starts at teacher token 2: nothing shared; unshared 5, 4, 3 sorted
    assert (t.shared_ids[1] == -1).all()
    np.testing.assert_allclose(np.exp(t.unshared_logprobs[1]), [0.6, 0.3, 0.05], rtol=1e-6)
    # merge scales and group log-probs: realised teacher tokens 3 (0.05), 1 (0.5), 4 (0.3)
    np.testing.assert_allclose(t.continuation_logprob, [np.log(0.5), 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(t.group_logprob, [np.log(0.05 * 0.5), np.log(0.3), 0, 0], rtol=1e-6)
    assert (t.shared_ids[2:] == -1).all() and np.isneginf(t.unshared_logprobs[2:]).all()


def test_build_targets_errors():
    alignment, vocab, teacher_ids, cand, lps = hand_built_targets()
    with pytest.raises(ValueError, match="realised token 9"):
        build_targets(alignment, np.array([3, 1, 9]), cand, lps, vocab, top_k=3)
    with pytest.raises(ValueError, match="top_k must lie"):
        build_targets(alignment, teacher_ids, cand, lps, vocab, top_k=5)
    with pytest.raises(ValueError, match="teacher arrays"):
        build_targets(alignment, teacher_ids[:2], cand, lps, vocab, top_k=3)
    with pytest.raises(ValueError, match="outside the map"):
        build_targets(alignment, teacher_ids, np.where(cand == 5, 6, cand), lps, vocab, top_k=3)
    assert realised_logprobs(teacher_ids, cand, lps).tolist() == pytest.approx(np.log([0.05, 0.5, 0.3]).tolist())


def test_concatenate_targets_renumbers_groups():
    alignment, vocab, teacher_ids, cand, lps = hand_built_targets()
    one = build_targets(alignment, teacher_ids, cand, lps, vocab, top_k=3)
    both = concatenate_targets([one, one])
    assert both.group_index.tolist() == [0, 1, 1, -1, 2, 3, 3, -1]
    assert both.num_groups == 4 and both.shared_ids.shape == (8, 4)
    with pytest.raises(ValueError, match="at least one"):
        concatenate_targets([])


def test_merging_slots_with_the_same_student_id_against_a_loop():
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 6, size=(50, 7)).astype(np.int32)
    lps = np.where(ids >= 0, np.log(rng.random((50, 7))), -np.inf)
    got_ids, got_lps = _merge_same_ids(ids, lps)
    for row in range(50):
        want: dict[int, float] = {}
        first: dict[int, int] = {}
        for slot, (token, lp) in enumerate(zip(ids[row], lps[row], strict=True)):
            if token >= 0:
                want[int(token)] = want.get(int(token), 0.0) + float(np.exp(lp))
                first.setdefault(int(token), slot)
        expected_ids = np.full(7, -1)
        for token, slot in first.items():
            expected_ids[slot] = token
        assert got_ids[row].tolist() == expected_ids.tolist()
        for token, slot in first.items():
            assert np.exp(got_lps[row, slot]) == pytest.approx(want[token], rel=1e-12)
        assert np.isneginf(got_lps[row][expected_ids < 0]).all()


def test_smollm2_tokenizer_against_a_tiny_teacher(smollm2_dir, teacher):
    """A real 49152-id byte-level tokenizer (SmolLM2's, from the session's export) as student and as teacher."""
    from transformers import AutoTokenizer

    smol = TokenizerBytes.of(AutoTokenizer.from_pretrained(smollm2_dir))
    assert smol.byte_level and len(smol.pieces) == 49152
    assert smol.pieces[smol.tokenizer.eos_token_id] is None
    for text in TEXTS:
        ids = smol.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(smol.token_bytes(ids)) == text.encode()
        seq = render_teacher_sequence(smol, teacher, MESSAGES, ids + [smol.tokenizer.eos_token_id])
        back = render_teacher_sequence(teacher, smol, MESSAGES, seq.completion_ids)
        assert seq.text == back.text == text
        assert back.completion_ids.tolist() == ids
        # the groups do not depend on which side is the student
        assert back.alignment.num_groups == seq.alignment.num_groups
        assert back.alignment.student_group.tolist() == seq.alignment.teacher_group.tolist()
        assert back.alignment.teacher_group.tolist() == seq.alignment.student_group[:-1].tolist()
    assert smol.tokenizer.decode(back.prompt_ids).startswith("<|im_start|>system\n")


def test_an_empty_completion_has_no_groups(student, teacher):
    vocab = VocabularyMap.from_token_bytes(student, teacher)
    for ids in ([], [student.tokenizer.eos_token_id]):
        seq = render_teacher_sequence(student, teacher, MESSAGES, ids)
        assert seq.text == "" and seq.completion_ids.shape == (0,) and seq.alignment.num_groups == 0
        targets = build_targets(seq.alignment, seq.completion_ids, np.zeros((0, 5), np.int32),
                                np.zeros((0, 5), np.float32), vocab, top_k=4)
        assert targets.group_index.tolist() == [-1] * len(ids) and targets.num_groups == 0


def test_a_sentencepiece_style_teacher(student, teacher):
    """``▁`` pieces and ``<0xNN>`` byte fallback have exact bytes; the space the tokenizer puts before the text is
    taken off (a lone ``▁`` first token is excluded); the byte-level vocabularies share its space-led pieces."""
    sp = TokenizerBytes.of(sentencepiece_tokenizer())
    assert not sp.byte_level and sp.prefix_space
    ids, spans, included = teacher_completion_ids(sp, "The cat")
    assert sp.tokenizer.convert_ids_to_tokens(ids.tolist())[0].startswith("\u2581")  # "▁The": its space is taken off
    assert spans[included].tolist()[0][0] == 0 and spans[included][-1, 1] == len(b"The cat")
    ids, spans, included = teacher_completion_ids(sp, "x")  # "▁" then the byte-fallback piece <0x78>
    assert sp.tokenizer.convert_ids_to_tokens(ids.tolist()) == ["\u2581", "<0x78>"]
    assert included.tolist() == [False, True] and spans.tolist() == [[-1, -1], [0, 1]]
    for text in TEXTS:
        s_ids = student.tokenizer(text, add_special_tokens=False)["input_ids"]
        seq = render_teacher_sequence(student, sp, MESSAGES, s_ids)
        a = seq.alignment
        s_pieces, t_pieces = student.token_bytes(s_ids), sp.token_bytes(seq.completion_ids)
        for g in range(a.num_groups):  # each group spells the same bytes (up to the taken-off leading space)
            s_bytes = b"".join(s_pieces[i] for i in np.nonzero(a.student_group == g)[0])
            t_bytes = b"".join(t_pieces[i] for i in np.nonzero(a.teacher_group == g)[0])
            assert t_bytes == s_bytes or (g == 0 and t_bytes == b" " + s_bytes)
        back = render_teacher_sequence(sp, teacher, MESSAGES, seq.completion_ids)  # the SentencePiece side as student
        assert back.text.lstrip(" ") == text.lstrip(" ")
    shared = VocabularyMap.from_token_bytes(student, sp)
    assert {b" The", b" today"} <= {sp.pieces[u] for u in np.nonzero(shared.teacher_to_student >= 0)[0]}
