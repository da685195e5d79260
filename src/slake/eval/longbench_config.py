"""LongBench v1 constants: prompt templates, generation lengths, languages, chat-template rule.

The templates are the official ``dataset2prompt`` strings of LongBench v1 (including their
original spelling, e.g. ``asconcisely``), so that scores stay comparable with published numbers.
"""

from __future__ import annotations

__all__ = [
    "DATASET2PROMPT",
    "DATASET2MAXLEN",
    "DATASET2LANGUAGE",
    "DATASET2CATEGORY",
    "NO_CHAT_TEMPLATE_DATASETS",
    "CLASSIFICATION_DATASETS",
    "LONGBENCH_DATASETS",
    "LONGBENCH_E_DATASETS",
    "base_dataset",
]

_MULTIDOC_EN = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULE = (
    'If the question cannot be answered based on the information in the article, write "unanswerable". '
    'If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. " + _QASPER_RULE + "\n\nArticle: {context}\n\n Answer the question "
        "based on the above article as concisely as you can, using a single phrase or sentence if possible. "
        + _QASPER_RULE
        + "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。"
        "\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _MULTIDOC_EN,
    "2wikimqa": _MULTIDOC_EN,
    "musique": _MULTIDOC_EN,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501 (the official prompt)
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501 (the official prompt)
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501 (the official prompt)
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

DATASET2LANGUAGE: dict[str, str] = {
    **{d: "en" for d in DATASET2PROMPT},
    **{d: "zh" for d in ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")},
    **{d: "code" for d in ("lcc", "repobench-p")},
}

DATASET2CATEGORY: dict[str, str] = {
    **{d: "single_doc_qa" for d in ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh")},
    **{d: "multi_doc_qa" for d in ("hotpotqa", "2wikimqa", "musique", "dureader")},
    **{d: "summarization" for d in ("gov_report", "qmsum", "multi_news", "vcsum")},
    **{d: "few_shot" for d in ("trec", "triviaqa", "samsum", "lsht")},
    **{d: "synthetic" for d in ("passage_count", "passage_retrieval_en", "passage_retrieval_zh")},
    **{d: "code" for d in ("lcc", "repobench-p")},
}

#: Datasets whose prompt is fed without the chat template (official ``pred.py``).
NO_CHAT_TEMPLATE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

#: Datasets scored by the class names found in the prediction (official ``classification_score``): their records
#: carry ``all_classes``.
CLASSIFICATION_DATASETS: frozenset[str] = frozenset({"trec", "lsht"})

LONGBENCH_DATASETS: tuple[str, ...] = tuple(DATASET2PROMPT)

#: Datasets of LongBench-E (uniform length distribution), named ``<dataset>_e``.
LONGBENCH_E_DATASETS: tuple[str, ...] = tuple(
    f"{d}_e"
    for d in (
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "gov_report",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
        "repobench-p",
    )
)


def base_dataset(name: str) -> str:
    """``"qasper_e"`` -> ``"qasper"``; validates the name."""
    base = name[:-2] if name.endswith("_e") else name
    if base not in DATASET2PROMPT:
        raise KeyError(f"unknown LongBench dataset {name!r}")
    return base
