"""LongBench v1 per-answer metrics against hand-computed values (see the comment next to each case)."""

from __future__ import annotations

import pytest

from eval.longbench import metrics as m

# ----------------------------------------------------------------------------- QA F1


def test_normalize_answer_drops_case_punctuation_articles():
    assert m.normalize_answer("The  Cat, sat!  an apple") == "cat sat apple"


def test_qa_f1_articles_and_punctuation():
    # "The cat sat" -> "cat sat" (2 tokens); "a cat sat down." -> "cat sat down" (3 tokens).
    # common = 2, P = 2/2, R = 2/3, F1 = 2*1*(2/3) / (1 + 2/3) = (4/3)/(5/3) = 0.8
    assert m.qa_f1_score("The cat sat", "a cat sat down.") == pytest.approx(0.8)


def test_qa_f1_counts_repeated_tokens_as_multiset():
    # pred "paris paris" vs gold "paris": common = min(2, 1) = 1, P = 1/2, R = 1/1, F1 = 2/3
    assert m.qa_f1_score("Paris paris", "Paris") == pytest.approx(2 / 3)


def test_qa_f1_no_overlap_and_empty():
    assert m.qa_f1_score("London", "Paris") == 0.0
    assert m.qa_f1_score("", "Paris") == 0.0
    assert m.qa_f1_score("the", "a") == 0.0  # both normalize to nothing


def test_jieba_segmentation_of_test_strings():
    # The zh cases below are computed by hand from these (jieba 0.42.1 precise-mode) tokens.
    assert m._jieba_cut("我爱北京天安门") == ["我", "爱", "北京", "天安门"]
    assert m._jieba_cut("我爱北京") == ["我", "爱", "北京"]
    assert m._jieba_cut("北京是中国的首都。") == ["北京", "是", "中国", "的", "首都", "。"]
    assert m._jieba_cut("中国的首都是北京") == ["中国", "的", "首都", "是", "北京"]


def test_qa_f1_zh():
    # pred 4 tokens [我 爱 北京 天安门], gold 3 tokens [我 爱 北京]: common 3,
    # P = 3/4, R = 1, F1 = 2*(3/4)/(7/4) = 6/7
    assert m.qa_f1_zh_score("我爱北京天安门", "我爱北京") == pytest.approx(6 / 7)
    # "。" normalizes to "" and is dropped: both sides are the same 5 tokens -> 1.0
    assert m.qa_f1_zh_score("北京是中国的首都。", "中国的首都是北京") == pytest.approx(1.0)
    assert m.qa_f1_zh_score("上海", "北京") == 0.0


def test_normalize_zh_answer():
    assert m.normalize_zh_answer("北京，是 首都！A.") == "北京是首都a"


# ----------------------------------------------------------------------------- ROUGE-L


def test_rouge_l_single_sentence():
    # tokens: pred [the cat sat on the mat], ref [the cat lay on the mat]; LCS = the cat on the mat = 5
    # P = R = 5/6 -> F = 5/6
    assert m.rouge_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)


def test_rouge_l_is_case_sensitive_like_official():
    # official `rouge` splits on spaces only: "The" != "the". LCS = cat sat = 2 of 3 each -> 2/3
    assert m.rouge_score("The cat sat", "the cat sat") == pytest.approx(2 / 3)


def test_rouge_l_summary_level_over_period_sentences():
    # sentences pred [the cat sat | the dog ran], ref [the dog ran | the cat sat]:
    # each reference sentence is fully covered by one prediction sentence -> union LCS hits 6 of 6
    assert m.rouge_score("the cat sat. the dog ran.", "the dog ran. the cat sat.") == pytest.approx(1.0)
    # the period is a sentence separator, not a token
    assert m.rouge_score("Hello world.", "Hello world") == pytest.approx(1.0)


def test_rouge_l_empty_prediction_scores_zero():
    assert m.rouge_score("", "the cat sat") == 0.0
    assert m.rouge_score("...", "the cat sat") == 0.0


def test_rouge_l_counts_repeats_unlike_official():
    # documented deviation: tokens "a a b" vs "a b": LCS = 2, P = 2/3, R = 1, F = 0.8
    # (the official `rouge` package counts distinct words and would give 1.0)
    assert m.rouge_score("a a b", "a b") == pytest.approx(0.8)


def test_rouge_zh():
    # jieba: pred [我 爱 北京 天安门] (4), ref [我 爱 北京] (3), LCS 3: P = 3/4, R = 1 -> F = 6/7
    assert m.rouge_zh_score("我爱北京天安门", "我爱北京") == pytest.approx(6 / 7)
    # pred [中国 的 首都 是 北京] vs ref [北京 是 中国 的 首都 。]: LCS = 中国 的 首都 = 3,
    # P = 3/5, R = 3/6, F = 2*(0.6*0.5)/(1.1) = 6/11
    assert m.rouge_zh_score("中国的首都是北京", "北京是中国的首都。") == pytest.approx(6 / 11)


# ----------------------------------------------------------------------------- classification

CLASSES = ["location", "other location", "person"]


def test_classification_substring_of_truth_is_discarded():
    # matches: "location", "other location"; "location" is a strict substring of the truth -> dropped
    assert m.classification_score("other location", "other location", all_classes=CLASSES) == 1.0


def test_classification_several_classes_named_share_the_credit():
    # matches: location, other location, person; none is inside "person" -> 3 matches, truth among them
    score = m.classification_score("person or other location", "person", all_classes=CLASSES)
    assert score == pytest.approx(1 / 3)


def test_classification_wrong_or_no_class():
    assert m.classification_score("person", "other location", all_classes=CLASSES) == 0.0
    # no class named: 0.0 (the official difflib fallback is dead code)
    assert m.classification_score("no idea", "person", all_classes=CLASSES) == 0.0


def test_classification_keeps_official_remove_while_iterating_quirk():
    # matches [loc, location, other location]; removing "loc" makes the loop skip "location",
    # so two matches remain and the truth gets 1/2 (a quirk-free version would give 1.0)
    classes = ["loc", "location", "other location"]
    assert m.classification_score("other location", "other location", all_classes=classes) == 0.5


def test_classification_requires_classes():
    with pytest.raises(ValueError, match="all_classes"):
        m.classification_score("x", "x", all_classes=None)


# ----------------------------------------------------------------------------- retrieval / count


def test_retrieval_en():
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("Paragraph 3 or Paragraph 13", "Paragraph 3") == 0.5  # numbers [3, 13]
    assert m.retrieval_score("Paragraph 30", "Paragraph 3") == 0.0  # whole numbers, not substrings
    assert m.retrieval_score("I cannot tell", "Paragraph 3") == 0.0  # no number at all


def test_retrieval_zh():
    assert m.retrieval_zh_score("段落5", "段落5") == 1.0
    assert m.retrieval_zh_score("答案是段落5，不是段落12", "段落5") == 0.5


def test_retrieval_bad_ground_truth_is_named():
    with pytest.raises(ValueError, match="Paragraph"):
        m.retrieval_score("3", "Section 3")


def test_count():
    assert m.count_score("There are 12 unique paragraphs.", "12") == 1.0
    assert m.count_score("12 or 13", "12") == 0.5
    assert m.count_score("1, 2, 12, 12", "12") == 0.5  # numbers [1, 2, 12, 12]: 2 of 4
    assert m.count_score("I don't know", "12") == 0.0


# ----------------------------------------------------------------------------- code


def test_code_sim_uses_first_plain_code_line():
    prediction = "```python\n# the next line\n// also a comment\nreturn x + 1\nmore()"
    assert m.code_sim_score(prediction, "return x + 1") == 1.0


def test_code_sim_ratio_rounded_like_fuzzywuzzy():
    # difflib ratio = 2*M/T. "x = 1" vs "x = 2": common block "x = " (M=4), T=10 -> 0.8
    assert m.code_sim_score("x = 1", "x = 2") == pytest.approx(0.8)
    # "abc" vs "abd": block "ab" (M=2), T=6 -> 0.6667 -> fuzz.ratio rounds to 67 -> 0.67
    assert m.code_sim_score("abc", "abd") == pytest.approx(0.67)
    # leading newlines are skipped before taking lines
    assert m.code_sim_score("\n\nfoo()", "foo()") == 1.0


def test_code_sim_is_difflib_not_indel():
    # fuzzywuzzy without python-Levenshtein = difflib Ratcliff-Obershelp: the longest block of
    # "aba" vs "bca" is the first "a" (a[0] = b[2]); nothing is left on either side -> M=1,
    # 2*1/6 = 0.333 -> 33. An LCS/Indel ratio (rapidfuzz) would find "ba" -> 67.
    assert m.code_sim_score("aba", "bca") == pytest.approx(0.33)


def test_code_sim_no_code_line():
    assert m.code_sim_score("# only a comment", "foo()") == 0.0
