"""Language identification, offline: py3langid's naive Bayes model over byte n-grams (140 labels),
which ships inside the package, so nothing is downloaded.

    from keel.data.langid import identify_language

    identify_language("Der schnelle braune Fuchs springt über den faulen Hund.")  # ("de", 0.98)

Columns added by `language_columns`: `language`, an ISO 639 code (py3langid's labels: two letters
where ISO 639-1 has one, "en", "de", "zh"; three otherwise, "yue", "arz"; "zxx" for text with no
linguistic content, and "und" for text with nothing but whitespace), and `language_score`, the
probability of that language in [0, 1]. The probability is py3langid's own normalisation
(`norm_probs=True`): a softmax over the languages of the model's log-likelihoods divided by
sqrt(text bytes). Without the division a softmax of naive Bayes log-likelihoods is 1.0 for almost
any text longer than a sentence; with it, English Wikipedia paragraphs score about 0.99, a
one-sentence text 0.6 to 0.98, and text without letters a few hundredths.

Speed: 1.5 to 4 MB of text a second on one core, linear in the text length (py3langid walks the
bytes in Python): the slowest of run_quality's attributes.
"""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.compute as pc
from py3langid.langid import MODEL_FILE, LanguageIdentifier

LANGUAGE_COLUMN = "language"
LANGUAGE_SCORE_COLUMN = "language_score"
UNDETERMINED = "und"
"""The ISO 639-2 code for "undetermined": the language of an empty or all-whitespace text."""


def identify_language(text: str) -> tuple[str, float]:
    """(ISO 639 code, probability in [0, 1]) of one text; ("und", 0.0) when it is blank."""
    if not text.strip():
        return UNDETERMINED, 0.0
    language, probability = _identifier().classify(text)
    return language, min(max(float(probability), 0.0), 1.0)


def language_columns(texts: pa.Array | pa.ChunkedArray) -> dict[str, pa.Array]:
    """`language` (string) and `language_score` (float64) for a batch of texts; a null text counts
    as blank."""
    results = [identify_language(text) for text in pc.fill_null(texts, "").to_pylist()]
    return {
        LANGUAGE_COLUMN: pa.array([language for language, _ in results], pa.string()),
        LANGUAGE_SCORE_COLUMN: pa.array([score for _, score in results], pa.float64()),
    }


@functools.cache
def _identifier() -> LanguageIdentifier:
    """The model, loaded once per process (about 0.5 s) from the file inside the package."""
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
