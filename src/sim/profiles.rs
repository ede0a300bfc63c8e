//! Named parameter sets derived from published figures (see `docs/sim.md`,
//! "Profiles", for the sources and the arithmetic behind each number).

use super::SimConfig;

/// Names accepted by `--profile`.
pub const NAMES: &[&str] = &["llama-8b-h100", "llama-70b-h100x4", "llama-8b-l4", "tiny"];

/// Look up a profile by name.
pub fn get(name: &str) -> Option<SimConfig> {
    let base = SimConfig::base();
    let cfg = match name {
        // Llama-3.1-8B, bf16, 1x H100 SXM 80 GB, vLLM V1 defaults for an
        // OpenAI server on a >=70 GiB GPU.
        "llama-8b-h100" => SimConfig {
            profile: name.into(),
            model: "sim-llama-8b".into(),
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_blocks: 26_000,
            max_model_len: 32_768,
            step_base_ms: 7.0,
            per_seq_ms: 0.06,
            per_prefill_token_ms: 0.07,
            ..base
        },
        // Llama-3.1-70B, bf16, tensor parallel over 4x H100 SXM.
        "llama-70b-h100x4" => SimConfig {
            profile: name.into(),
            model: "sim-llama-70b".into(),
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_blocks: 24_000,
            max_model_len: 32_768,
            step_base_ms: 18.0,
            per_seq_ms: 0.12,
            per_prefill_token_ms: 0.12,
            kv_transfer_per_token_ms: 0.004,
            cpu_load_per_token_ms: 0.003,
            ..base
        },
        // Llama-3.1-8B, bf16, 1x L4 24 GB (small KV, slow decode).
        "llama-8b-l4" => SimConfig {
            profile: name.into(),
            model: "sim-llama-8b".into(),
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            block_size: 16,
            num_blocks: 2_000,
            max_model_len: 8_192,
            step_base_ms: 55.0,
            per_seq_ms: 0.4,
            per_prefill_token_ms: 0.35,
            cpu_load_per_token_ms: 0.01,
            ..base
        },
        // Not a real GPU: small and quick, for tests and demos.
        "tiny" => SimConfig {
            profile: name.into(),
            model: "sim-tiny".into(),
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            block_size: 16,
            num_blocks: 256,
            max_model_len: 2048,
            step_base_ms: 2.0,
            per_seq_ms: 0.1,
            per_prefill_token_ms: 0.02,
            ..base
        },
        _ => return None,
    };
    Some(cfg)
}
