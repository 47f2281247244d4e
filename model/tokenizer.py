"""Tokenization over the `tokenizers` library: prompts, truncation side, offsets, ids.

Long texts are cut by characters before they are tokenized: a 2 MB string of which the model
keeps 256 tokens would otherwise cost seconds of tokenizer time. The cut keeps far more
characters than the kept tokens can span, on the side that truncation keeps, and its result
is used only when it still overflows the limit by a margin; otherwise the whole text is
tokenized, so the tokens are always those of the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import orjson
from tokenizers import Encoding, Tokenizer, normalizers

from model.errors import InputError, InputTooLongError, TokenIdError
from model.plain_ascii import is_plain, plain_ascii_json

Direction = Literal["right", "left"]
TokenizerInput = str | Sequence[int]

# Characters kept per token of the limit when a long text is cut. Tokens average 4 to 5
# characters of English; 16 leaves room for long words and runs of spaces.
CHARS_PER_TOKEN = 16
# Tokens the cut text must produce past the limit for the cut to be trusted: a word split at
# the cut changes only the tokens near it, far from the ones kept.
CUT_MARGIN = 64
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class TokenDetails:
    """What an input's tokens are, beside their ids: for the routes that show tokens, and for
    cutting texts into chunks."""

    tokens: list[str]
    # Character offsets into the (prompted) input text, for a pair into the text each token
    # comes from; None for pre-tokenized input.
    offsets: list[tuple[int, int]] | None
    special: list[bool]


# Inputs whose details nobody reads: ids an engine received, the windows of a long text.
NO_DETAILS = TokenDetails([], None, [])


# Not frozen: one is made per input, in a front end and again in an engine, and a frozen
# dataclass's __init__ sets each field through object.__setattr__, four times the cost of a
# plain one; and a text's details are read off its Encoding when first asked for, so two
# compare by what their details hold (`__eq__`), not by where those are.
@dataclass(slots=True, eq=False)
class Encoded:
    """One input after tokenization (and truncation)."""

    ids: list[int]
    truncated: bool
    # Leading tokens that belong to the prompt, counted as sentence-transformers counts them
    # (the leading special token included); pooling leaves them out when include_prompt is off.
    prompt_length: int = 0
    # Segment of each token for a pair of texts; None for a single text.
    type_ids: list[int] | None = None
    # A text's details stay in the tokenizer's Encoding until asked for: most requests want
    # only vectors, and three Python lists per input cost a sixth of the tokenizing.
    details: TokenDetails | Encoding = NO_DETAILS

    @property
    def tokens(self) -> list[str]:
        return self._details().tokens

    @property
    def offsets(self) -> list[tuple[int, int]] | None:
        return self._details().offsets

    @property
    def special(self) -> list[bool]:
        return self._details().special

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Encoded):
            return NotImplemented
        return self._compared() == other._compared()

    def _compared(self) -> tuple[object, ...]:
        return self.ids, self.truncated, self.prompt_length, self.type_ids, self._details()

    def _details(self) -> TokenDetails:
        details = self.details
        if isinstance(details, Encoding):
            details = self.details = details_of(details)
        return details


def details_of(encoding: Encoding, offsets: list[tuple[int, int]] | None = None) -> TokenDetails:
    """`encoding`'s details, with `offsets` in place of its own where given (a pair's, moved
    into the text each token comes from)."""
    special = [bool(flag) for flag in encoding.special_tokens_mask]
    return TokenDetails(encoding.tokens, encoding.offsets if offsets is None else offsets, special)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What a `TextTokenizer` is built from: plain values, so that it crosses to a front-end
    process, which builds the same tokenizer without reading the folder again."""

    tokenizer_json: str
    max_length: int
    vocab_size: int
    lowercase: bool = False
    truncation_side: Direction | None = None
    token_types: bool = True

    def build(self) -> TextTokenizer:
        """A front end's tokenizer: it tokenizes every request, where plain ASCII twins pay
        for the memory they take (an engine's only tokenizes its warm-up)."""
        return TextTokenizer(
            self.tokenizer_json,
            self.max_length,
            self.vocab_size,
            lowercase=self.lowercase,
            truncation_side=self.truncation_side,
            token_types=self.token_types,
            plain_ascii_twins=True,
        )


class _TokenizerSet(NamedTuple):
    """A tokenizer without truncation, with it on each side, and for a pair's texts."""

    untruncated: Tokenizer
    truncating: dict[Direction, Tokenizer]
    pair_texts: Tokenizer

    def each(self) -> list[Tokenizer]:
        return [self.untruncated, *self.truncating.values(), self.pair_texts]


class TextTokenizer:
    """Thread-safe: each truncation setting has its own immutable `Tokenizer`."""

    def __init__(
        self,
        tokenizer_json: str,
        max_length: int,
        vocab_size: int,
        *,
        lowercase: bool = False,
        truncation_side: Direction | None = None,
        token_types: bool = True,
        plain_ascii_twins: bool = False,
    ) -> None:
        """`plain_ascii_twins`: tokenize plain ASCII text through twins that skip a BERT
        tokenizer's Unicode lookups (model/plain_ascii.py), at the memory of a second copy of
        the vocabulary per truncation setting."""
        self.max_length = max_length
        # Whether a pair's encodings carry segment ids (model/tokenizer_class.py).
        self.token_types = token_types
        self.vocab_size = vocab_size
        # The side a request that names none is cut on: as transformers picks it, the folder's
        # tokenizer_config.json (`truncation_side`), else the truncation tokenizer.json saved
        # (which tokenizers writes as Left or Right), else the right.
        parsed = orjson.loads(tokenizer_json)
        saved = parsed.get("truncation") or {}
        saved_side: Direction = "left" if saved.get("direction") == "Left" else "right"
        self.truncation_side = truncation_side or saved_side
        self.spec = TokenizerSpec(
            tokenizer_json, max_length, vocab_size, lowercase, self.truncation_side, token_types
        )
        self._lowercase = lowercase
        tokenizers = self._set_of(tokenizer_json)
        self._untruncated, self._truncating, self._pair_texts = tokenizers
        # Their twins for plain ASCII text, where the model's tokenizer is BERT's kind, by the
        # tokenizer each stands in for.
        self._plain_twins: dict[Tokenizer, Tokenizer] = {}
        plain_json = plain_ascii_json(parsed) if plain_ascii_twins else None
        if plain_json is not None:
            self._plain_twins = dict(
                zip(tokenizers.each(), self._set_of(plain_json).each(), strict=True)
            )
        added = self._untruncated.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._prompt_lengths: dict[str, int] = {}

    def _set_of(self, tokenizer_json: str) -> _TokenizerSet:
        truncating: dict[Direction, Tokenizer] = {
            "right": self._configured(tokenizer_json, "right"),
            "left": self._configured(tokenizer_json, "left"),
        }
        # The texts of a pair are tokenized one by one without the post-processor, which
        # then runs once on the pair (`post_process`): it truncates and adds the template.
        pair_texts = self._configured(tokenizer_json, None)
        pair_texts.post_processor = None
        return _TokenizerSet(self._configured(tokenizer_json, None), truncating, pair_texts)

    def _configured(self, tokenizer_json: str, direction: Direction | None) -> Tokenizer:
        # tokenizer.json files often carry padding and truncation from training; drop both.
        tokenizer = Tokenizer.from_str(tokenizer_json)
        tokenizer.no_padding()
        tokenizer.no_truncation()
        if self._lowercase and not _has_lowercase(tokenizer.normalizer):
            # sentence-transformers' do_lower_case: a Lowercase normalizer in front (unless it
            # finds one there already), so that offsets still point into the text as sent.
            current = tokenizer.normalizer
            steps = [normalizers.Lowercase()] + ([current] if current is not None else [])
            tokenizer.normalizer = normalizers.Sequence(steps)
        if direction is not None:
            tokenizer.enable_truncation(self.max_length, direction=direction)
        return tokenizer

    def encode(
        self,
        inputs: Sequence[TokenizerInput],
        *,
        truncate: bool = True,
        direction: Direction | None = None,
        add_special_tokens: bool = True,
        prompt: str = "",
        details: bool = True,
    ) -> list[Encoded]:
        """Texts (with `prompt` in front) go through the tokenizer in one batch call; id lists
        are checked and cut (on `direction`, by default the model's side). Without `details`
        a text keeps its ids, truncation and segments only (its tokens and offsets read
        empty), and texts sent together are tokenized without tracking offsets."""
        direction = direction or self.truncation_side
        results: list[Encoded] = []
        texts: list[tuple[int, str]] = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                check_unicode(index, item)
                texts.append((index, item))
        encoded = self._encode_texts(
            texts, truncate, direction, add_special_tokens, prompt, details
        )
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                results.append(encoded[index])
            else:
                results.append(self._from_ids(index, item, truncate, direction))
        return results

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncate: bool = True,
        direction: Direction | None = None,
    ) -> list[Encoded]:
        """Each pair by the tokenizer's pair template (type ids set), cut longest-first on
        `direction` (by default the model's side) as `tokenizers` (and so transformers) cuts
        pairs.

        The cut is made here, not by `tokenizers`: it builds every pair of the two texts'
        overflowing pieces, which for two long texts grows with the product of their lengths.
        """
        direction = direction or self.truncation_side
        texts: list[str] = []
        for index, (first, second) in enumerate(pairs):
            check_unicode(index, first)
            check_unicode(index, second)
            texts += (first, second)
        cut = [self._cut(text, direction) for text in texts]
        pieces = self._encode(self._pair_texts, cut, False)
        added = self._untruncated.num_special_tokens_to_add(True)
        budget = max(self.max_length - added, 0)  # tokens left for the two texts
        results = []
        for index in range(len(pairs)):
            sides = (2 * index, 2 * index + 1)
            for side in sides:
                if cut[side] is not texts[side] and len(pieces[side].ids) < budget + CUT_MARGIN:
                    # Too few tokens for the cut to be trusted: tokenize the whole text.
                    [pieces[side]] = self._encode(self._pair_texts, [texts[side]], False)
                    cut[side] = texts[side]
            was_cut = (cut[sides[0]] is not texts[sides[0]], cut[sides[1]] is not texts[sides[1]])
            counts = (len(pieces[sides[0]].ids), len(pieces[sides[1]].ids))
            length = sum(counts) + added
            if not truncate and length > self.max_length:
                raise InputTooLongError(index, length, self.max_length, at_least=any(was_cut))
            if _order_unknown(counts, was_cut, budget):
                counts = (
                    self._whole_length(texts[sides[0]]) if was_cut[0] else counts[0],
                    self._whole_length(texts[sides[1]]) if was_cut[1] else counts[1],
                )
            kept = longest_first(counts, budget)
            for side, keep in zip(sides, kept, strict=True):
                pieces[side].truncate(keep, direction=direction)
            encoding = self._untruncated.post_process(pieces[sides[0]], pieces[sides[1]])
            # A left cut drops the start of a text: offsets count from the text as sent.
            shift = [
                len(texts[side]) - len(cut[side]) if direction == "left" else 0 for side in sides
            ]
            results.append(
                Encoded(
                    ids=encoding.ids,
                    truncated=any(was_cut) or kept != counts,
                    type_ids=encoding.type_ids if self.token_types else None,
                    details=details_of(
                        encoding,
                        [
                            (start + shift[seq], end + shift[seq])
                            if seq is not None
                            else (start, end)
                            for seq, (start, end) in zip(
                                encoding.sequence_ids, encoding.offsets, strict=True
                            )
                        ],
                    ),
                )
            )
        return results

    def encode_whole(self, text: str, prompt: str = "") -> Encoded:
        """One text (with `prompt` in front) with every token, however many: a document to be
        cut into chunks, never truncated. The caller bounds its length (characters)."""
        check_unicode(0, text)
        [encoding] = self._encode(self._untruncated, [prompt + text], True)
        prompt_length = self.prompt_length(prompt) if prompt else 0
        return self._from_encoding(0, encoding, True, prompt_length=prompt_length)

    def _whole_length(self, text: str) -> int:
        [encoding] = self._encode(self._pair_texts, [text], False)
        return len(encoding.ids)

    def _encode_texts(
        self,
        texts: list[tuple[int, str]],
        truncate: bool,
        direction: Direction,
        add_special_tokens: bool,
        prompt: str,
        details: bool,
    ) -> dict[int, Encoded]:
        # A prompt survives a left cut: the text is cut and the prompt kept, by hand below.
        keep_prompt = bool(prompt) and truncate and direction == "left"
        # That cut finds the prompt's tokens by their offsets.
        offsets = details or keep_prompt
        tokenizer = (
            self._untruncated if keep_prompt or not truncate else self._truncating[direction]
        )
        cut = {index: self._cut(text, direction) for index, text in texts}
        batch = [prompt + cut[index] for index, _ in texts]
        encodings = self._encode(tokenizer, batch, add_special_tokens, offsets)
        prompt_length = self.prompt_length(prompt) if prompt else 0
        results: dict[int, Encoded] = {}
        for (index, text), encoding in zip(texts, encodings, strict=True):
            was_cut = cut[index] is not text
            if was_cut and not self._cut_is_exact(
                encoding, untruncated=tokenizer is self._untruncated
            ):
                # The cut text does not overflow by the margin: tokenize the whole text.
                [encoding] = self._encode(tokenizer, [prompt + text], add_special_tokens, offsets)
                was_cut = False
            result = self._from_encoding(
                index,
                encoding,
                truncate,
                was_cut=was_cut,
                prompt_length=prompt_length,
                details=offsets,
            )
            if was_cut and direction == "left" and offsets:
                # The cut dropped the start of the text: offsets count from the text as sent.
                result = _shift_offsets(result, len(prompt), len(text) - len(cut[index]))
            if keep_prompt:
                result = self._cut_keeping_prompt(result, len(prompt))
            results[index] = result
        return results

    def _encode(
        self,
        tokenizer: Tokenizer,
        texts: list[str],
        add_special_tokens: bool,
        offsets: bool = True,
    ) -> list[Encoding]:
        """`tokenizer` on `texts`, through its plain ASCII twin where every text is plain (a
        batch with one other text goes through `tokenizer` whole)."""
        twin = self._plain_twins.get(tokenizer)
        if twin is not None and all(map(is_plain, texts)):
            tokenizer = twin
        return _encode(tokenizer, texts, add_special_tokens, offsets)

    def _cut(self, text: str, direction: Direction) -> str:
        """The side of a long text that truncation keeps, ending at a whitespace if one is
        near; short texts come back as the same object."""
        limit = self.max_length * CHARS_PER_TOKEN + CUT_MARGIN * CHARS_PER_TOKEN
        if len(text) <= limit:
            return text
        if direction == "right":
            piece = text[:limit]
            space = max(piece.rfind(c) for c in _WHITESPACE)
            return piece[:space] if space > limit // 2 else piece
        piece = text[-limit:]
        spaces = [i for i in (piece.find(c) for c in _WHITESPACE) if i >= 0]
        space = min(spaces, default=-1)
        return piece[space + 1 :] if 0 <= space < limit // 2 else piece

    def _cut_is_exact(self, encoding: Encoding, untruncated: bool) -> bool:
        """Whether a cut text's tokens still overflow the limit by CUT_MARGIN."""
        if untruncated:
            return len(encoding.ids) >= self.max_length + CUT_MARGIN
        overflow = sum(
            1 for part in encoding.overflowing for flag in part.special_tokens_mask if not flag
        )
        return overflow >= CUT_MARGIN

    def prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt tokenized alone, less a trailing special token (as
        sentence-transformers measures it)."""
        if prompt not in self._prompt_lengths:
            [alone] = self._encode(self._untruncated, [prompt], True)
            length = len(alone.ids)
            if alone.special_tokens_mask and alone.special_tokens_mask[-1]:
                length -= 1
            self._prompt_lengths[prompt] = length
        return self._prompt_lengths[prompt]

    def _from_encoding(
        self,
        index: int,
        encoding: Encoding,
        truncate: bool,
        *,
        was_cut: bool = False,
        prompt_length: int = 0,
        details: bool = True,
    ) -> Encoded:
        if not truncate and len(encoding.ids) > self.max_length:
            raise InputTooLongError(index, len(encoding.ids), self.max_length, at_least=was_cut)
        truncated = bool(encoding.overflowing)
        kept: TokenDetails | Encoding = NO_DETAILS
        if details:
            # A truncated text's Encoding holds the tokens cut off too: read now, so that
            # those are not kept for the request's life.
            kept = details_of(encoding) if truncated else encoding
        return Encoded(
            ids=encoding.ids,
            truncated=truncated,
            prompt_length=prompt_length,
            details=kept,
        )

    def _cut_keeping_prompt(self, encoded: Encoded, prompt_chars: int) -> Encoded:
        """Left truncation of a prompted text: drop the text's first tokens, keep the prompt's
        and the special tokens at both ends."""
        excess = len(encoded.ids) - self.max_length
        if excess <= 0:
            return encoded
        assert encoded.offsets is not None, "texts have offsets"
        lead = 0
        while lead < len(encoded.ids) and (
            encoded.special[lead] or encoded.offsets[lead][0] < prompt_chars
        ):
            lead += 1
        trail = 0
        while trail < len(encoded.ids) - lead and encoded.special[-1 - trail]:
            trail += 1
        if len(encoded.ids) - lead - trail <= excess:
            # The prompt alone fills the limit: cut from the left as for any text.
            keep = list(range(excess, len(encoded.ids)))
        else:
            keep = [*range(lead), *range(lead + excess, len(encoded.ids))]
        return Encoded(
            ids=[encoded.ids[i] for i in keep],
            truncated=True,
            prompt_length=encoded.prompt_length,
            details=TokenDetails(
                tokens=[encoded.tokens[i] for i in keep],
                offsets=[encoded.offsets[i] for i in keep],
                special=[encoded.special[i] for i in keep],
            ),
        )

    def _from_ids(
        self, index: int, ids: Sequence[int], truncate: bool, direction: Direction
    ) -> Encoded:
        for position, token_id in enumerate(ids):
            if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise TokenIdError(
                    f"input {index}: token id {token_id!r} at position {position} is outside "
                    f"the vocabulary [0, {self.vocab_size})",
                    index,
                )
        kept = list(ids)
        if len(kept) > self.max_length:
            if not truncate:
                raise InputTooLongError(index, len(kept), self.max_length)
            # A plain cut: ids are taken as the caller made them, so a right cut drops their
            # closing special token rather than guessing which id that is.
            kept = kept[: self.max_length] if direction == "right" else kept[-self.max_length :]
        return Encoded(
            ids=kept,
            truncated=len(kept) < len(ids),
            details=TokenDetails(
                tokens=[self._untruncated.id_to_token(i) or "" for i in kept],
                offsets=None,
                special=[i in self._special_ids for i in kept],
            ),
        )

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._untruncated.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _has_lowercase(normalizer: normalizers.Normalizer | None) -> bool:
    """sentence-transformers' test: a Lowercase, or a Sequence holding one (a BertNormalizer
    that lowercases does not count)."""
    if isinstance(normalizer, normalizers.Sequence):
        steps = (normalizer[index] for index in range(len(normalizer)))
        return any(isinstance(step, normalizers.Lowercase) for step in steps)
    return isinstance(normalizer, normalizers.Lowercase)


def _shift_offsets(encoded: Encoded, after: int, shift: int) -> Encoded:
    """Offsets past character `after` (the prompt's end) moved on by `shift` characters;
    special tokens keep their (0, 0)."""
    assert encoded.offsets is not None, "texts have offsets"
    offsets = [
        (start, end)
        if special
        else (start + shift if start >= after else start, end + shift if end > after else end)
        for (start, end), special in zip(encoded.offsets, encoded.special, strict=True)
    ]
    return replace(encoded, details=TokenDetails(encoded.tokens, offsets, encoded.special))


def longest_first(lengths: tuple[int, int], budget: int) -> tuple[int, int]:
    """The tokens each text of a pair keeps within `budget`: `tokenizers`' LongestFirst, as it
    has it (the longer is cut down to the shorter first, then both to halves, the odd token
    to the longer one, or to the second when they are as long)."""
    first, second = lengths
    if first + second <= budget:
        return lengths
    shorter, longer = (second, first) if first > second else (first, second)
    longer = shorter if shorter > budget else max(shorter, budget - shorter)
    if shorter + longer > budget:
        shorter, longer = budget // 2, budget // 2 + budget % 2
    return (longer, shorter) if first > second else (shorter, longer)


def _order_unknown(counts: tuple[int, int], was_cut: tuple[bool, bool], budget: int) -> bool:
    """Whether the lengths a pair keeps could depend on how long a cut text is as a whole.

    A cut text keeps at least CUT_MARGIN tokens past the budget, so it is cut down in any case
    and its own length counts only through which text is longer; that decides something only
    when both texts are cut to halves of an odd budget (the odd token). It is known when the
    cut text is longer than the other, uncut one.
    """
    if budget % 2 == 0 or not any(was_cut):
        return False
    if all(was_cut):
        return True
    cut_length, other = counts if was_cut[0] else counts[::-1]
    return cut_length <= other


def _encode(
    tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool, offsets: bool = True
) -> list[Encoding]:
    """One text through `encode`: `encode_batch` hands even a single text to the library's
    thread pool, which costs more than the tokenizing itself (measured on the event loop),
    and lets go of the GIL, which an engine in the same process then holds for up to Python's
    switch interval. Several texts without `offsets` through `encode_batch_fast`, whose
    offsets are all (0, 0), for less work (docs/benchmarks.md)."""
    if len(texts) == 1:
        return [tokenizer.encode(texts[0], add_special_tokens=add_special_tokens)]
    if not offsets:
        return tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)


def check_unicode(index: int, text: str) -> None:
    """A lone surrogate (valid in JSON, `"\\ud800"`) is not text the tokenizer can take."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(
            f"input {index} is not valid Unicode: it holds a lone surrogate "
            f"({text[exc.start]!a}) at character {exc.start}",
            index,
        ) from exc
