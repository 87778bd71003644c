"""The offline teacher cache: score a dataset's completions with a teacher once (``fastdistill score``: the teacher's
top-K, or tokens sampled from its full distribution), read the rows back as
:class:`~fastdistill.rollout.RolloutSample`\\ s without a teacher server."""

from fastdistill.cache.format import CacheError, CacheSettings, ShardRecord, tokenizer_fingerprint
from fastdistill.cache.reader import TeacherCache
from fastdistill.cache.sampled import SampledScores
from fastdistill.cache.score import CompletionRow, ScoreSummary, completion_row, score_dataset

__all__ = ["CacheError", "CacheSettings", "CompletionRow", "SampledScores", "ScoreSummary", "ShardRecord",
           "TeacherCache", "completion_row", "score_dataset", "tokenizer_fingerprint"]
