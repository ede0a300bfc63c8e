//! Deterministic approximate tokenizer and the Llama-3-style chat template.
//!
//! Rules (documented in `docs/sim.md`):
//! - a run of ASCII letters/digits, with at most one leading space attached, is
//!   one token per [`MAX_WORD_BYTES`] bytes of the run (a longer run is split);
//! - any other whitespace run is one token (at most [`MAX_WORD_BYTES`] bytes each);
//! - every other character (punctuation, symbols, non-ASCII) is one token.
//!
//! A token's id is the xxh3 hash of its bytes, truncated to `u32`, so the same
//! text always yields the same ids in any process. Generated text is made of
//! tokens this tokenizer reproduces exactly, so a conversation that feeds the
//! previous answer back hits the prefix cache on it, as in a real engine.

use xxhash_rust::xxh3::xxh3_64;

/// Longest alphanumeric piece (leading space included) that is a single token.
pub const MAX_WORD_BYTES: usize = 6;

/// Id of one token's text.
pub fn token_id(text: &str) -> u32 {
    xxh3_64(text.as_bytes()) as u32
}

/// Split `text` into token pieces (borrowed slices of the input).
pub fn pieces(text: &str) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let c = b[i];
        if c == b' ' && i + 1 < b.len() && b[i + 1].is_ascii_alphanumeric() {
            // " word": the space travels with the word.
            i += 1;
            while i < b.len() && b[i].is_ascii_alphanumeric() && i - start < MAX_WORD_BYTES {
                i += 1;
            }
        } else if c.is_ascii_alphanumeric() {
            while i < b.len() && b[i].is_ascii_alphanumeric() && i - start < MAX_WORD_BYTES {
                i += 1;
            }
        } else if c.is_ascii_whitespace() {
            while i < b.len()
                && b[i].is_ascii_whitespace()
                && i - start < MAX_WORD_BYTES
                // leave a single space for a following word
                && !(b[i] == b' '
                    && i > start
                    && i + 1 < b.len()
                    && b[i + 1].is_ascii_alphanumeric())
            {
                i += 1;
            }
        } else {
            // One (possibly multi-byte) character.
            i += utf8_len(c);
            while i < b.len() && !text.is_char_boundary(i) {
                i += 1;
            }
        }
        out.push(&text[start..i.min(b.len())]);
    }
    out
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7f => 1,
        0xc0..=0xdf => 2,
        0xe0..=0xef => 3,
        _ => 4,
    }
}

/// Token ids of `text`.
pub fn encode(text: &str) -> Vec<u32> {
    pieces(text).into_iter().map(token_id).collect()
}

/// Number of tokens in `text`.
pub fn count(text: &str) -> usize {
    pieces(text).len()
}

const BOS: &str = "<|begin_of_text|>";
const START_HEADER: &str = "<|start_header_id|>";
const END_HEADER: &str = "<|end_header_id|>";
const EOT: &str = "<|eot_id|>";

/// Token ids of a chat conversation under a Llama-3-style template, ending with
/// the assistant generation prompt. Each message costs its content plus 4
/// template tokens (header start, role, header end, "\n\n") and 1 end token.
pub fn encode_chat<'a>(messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<u32> {
    let mut out = vec![token_id(BOS)];
    let header = |out: &mut Vec<u32>, role: &str| {
        out.push(token_id(START_HEADER));
        out.push(token_id(role));
        out.push(token_id(END_HEADER));
        out.push(token_id("\n\n"));
    };
    for (role, content) in messages {
        header(&mut out, role);
        out.extend(encode(content));
        out.push(token_id(EOT));
    }
    header(&mut out, "assistant");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_words_punctuation_and_space() {
        assert_eq!(
            pieces("Hello, world!  ok\nA"),
            vec!["Hello", ",", " world", "!", " ", " ok", "\n", "A"]
        );
        assert_eq!(
            pieces("internationalization"),
            vec!["intern", "ationa", "lizati", "on"]
        );
        assert_eq!(pieces(" abcdefgh"), vec![" abcde", "fgh"]);
        assert_eq!(pieces("héllo"), vec!["h", "é", "llo"]);
        assert!(pieces("").is_empty());
    }

    #[test]
    fn pieces_cover_the_text() {
        let t = "Some   text,\twith \u{1F600} emoji and    spaces. 12345678";
        assert_eq!(pieces(t).concat(), t);
    }

    #[test]
    fn stable_counts() {
        let t = "The quick brown fox jumps over the lazy dog.";
        assert_eq!(count(t), 10);
        assert_eq!(encode(t), encode(t));
    }

    #[test]
    fn chat_template_overhead() {
        let ids = encode_chat([("user", "hi there")]);
        // BOS + (4 + 2 + 1) + 4
        assert_eq!(ids.len(), 1 + 7 + 4);
    }
}
