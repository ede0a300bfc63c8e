//! `switchyard tokenize`: the real binary reads a request body on stdin and
//! prints the prompt token ids the gateway computes (the Python cross-check in
//! `tests/tokenize/crosscheck.py` compares them with vLLM's way of building them).

use std::io::Write;
use std::process::{Command, Output, Stdio};
use switchyard::api::Endpoint;
use switchyard::tokenize::{HfTokenizer, PromptTokenizer};

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-tokenizer");
const PARTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/chat-templates/parts.jinja"
);

fn tokenize(args: &[&str], body: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn ids(out: &Output) -> Vec<u32> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;

#[test]
fn prints_the_prompt_tokens_of_a_chat_request() {
    let out = tokenize(&["--model-dir", TINY], CHAT);
    let lib = HfTokenizer::from_dir(TINY, None).unwrap();
    let want = lib
        .prompt_tokens(Endpoint::ChatCompletions, CHAT.as_bytes())
        .unwrap();
    assert_eq!(ids(&out), &want[..]);
    let text = tokenize(&["--model-dir", TINY, "--render"], CHAT);
    assert_eq!(
        String::from_utf8_lossy(&text.stdout),
        "<s><|system|>\nBe brief.<|end|>\n<|user|>\na\nb<|end|>\n<|assistant|>\n\n"
    );
}

#[test]
fn a_chat_template_file_overrides_the_models() {
    let own = ids(&tokenize(&["--model-dir", TINY], CHAT));
    let parts = tokenize(
        &["--model-dir", TINY, "--chat-template", PARTS, "--render"],
        CHAT,
    );
    // The parts template loops over content parts: they stay separate, unjoined.
    assert!(String::from_utf8_lossy(&parts.stdout).contains("<|user|>\nab<|end|>"));
    assert_ne!(
        own,
        ids(&tokenize(
            &["--model-dir", TINY, "--chat-template", PARTS],
            CHAT
        ))
    );
}

#[test]
fn completions_and_responses_endpoints() {
    let ids_in = ids(&tokenize(
        &["--model-dir", TINY, "--endpoint", "completions"],
        r#"{"prompt":[1,2,3]}"#,
    ));
    assert_eq!(ids_in, vec![1, 2, 3]);
    let r = ids(&tokenize(
        &["--model-dir", TINY, "--endpoint", "responses"],
        r#"{"input":"hi","instructions":"Be brief."}"#,
    ));
    let c = ids(&tokenize(
        &["--model-dir", TINY],
        r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi"}]}"#,
    ));
    assert_eq!(
        r, c,
        "a responses request is tokenized as the equivalent chat"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let out = tokenize(&["--model-dir", TINY], "{not json");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("request body"), "{err}");
    let out = tokenize(&["--model-dir", "/nonexistent/model"], CHAT);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model/tokenizer.json"));
}
