"""The shipped long-tailed corpus of examples/mixed_length is what its generator makes, long-tailed."""

import statistics

from tests.example_modules import example_module

longtail = example_module("mixed_length", "longtail")
CORPUS, DOCUMENTS, LONGEST = longtail.CORPUS, longtail.DOCUMENTS, longtail.LONGEST
LongTailCorpus, make_documents = longtail.LongTailCorpus, longtail.make_documents


def test_shipped_documents_regenerate_identically_and_are_long_tailed():
    shipped = DOCUMENTS.read_text(encoding="utf-8").split("\n")[:-1]
    assert shipped == make_documents(CORPUS.read_text(encoding="utf-8"))
    lengths = sorted(len(d) for d in shipped)
    assert statistics.median(lengths) <= 16 and lengths[-1] == LONGEST
    assert sum(1 for n in lengths if n > 4 * statistics.median(lengths)) / len(lengths) < 0.2


def test_steps_are_deterministic_and_reach_the_token_budget():
    corpus = LongTailCorpus()
    a, b = corpus.step(3, 200), corpus.step(3, 200)
    assert [t.tolist() for t, _ in a] == [t.tolist() for t, _ in b]
    assert sum(len(t) for t, _ in a) >= 200
    assert all(t[1:].tolist() == y[:-1].tolist() for t, y in a)
