//! How the fake endpoint judges a request against a window of its own, as real servers do:
//! it counts the prompt with a tokenizer finer than compactd's (o200k × `percent` / 100,
//! plus a chat template's tokens per message), and a request that does not fit is refused
//! with the numbers (vLLM, OpenAI) or, streamed, answered with an empty body
//! (llama-cpp-python, which refuses the same request with the numbers when not streamed).

use compactd::tokens::Counting;
use serde_json::Value;

use super::fake_llm::error_body;

/// Template tokens the fake adds per message (ChatML: `<|im_start|>role\n…<|im_end|>\n`).
pub const FAKE_TEMPLATE_PER_MESSAGE: u64 = 5;

/// A window and how the fake says a request does not fit it.
#[derive(Clone, Copy, Debug)]
pub struct WindowSpec {
    /// The window, in the fake's tokens.
    pub n_ctx: u64,
    /// The fake's tokens per 100 o200k tokens (a local model's tokenizer cuts finer).
    pub percent: u64,
    /// What a request that does not fit gets.
    pub overflow: Overflow,
}

/// How a server answers a request longer than its window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// vLLM and OpenAI: 400 with the numbers when prompt + `max_tokens` exceed the window.
    Refuse,
    /// llama-cpp-python: when the prompt alone fills the window, a streamed request gets
    /// HTTP 200 with an empty body and a plain one a 400 with the numbers; `max_tokens`
    /// past the window is cut short silently.
    EmptyStream,
    /// Ollama: messages that do not fit are dropped from the prompt, the first (system)
    /// and the last kept, and the rest is answered as usual, its usage counting only what
    /// was kept.
    Truncate,
    /// llama.cpp's server: a prompt that alone fills the window is refused with the
    /// numbers; one that fits is answered until prompt and answer fill the window, the
    /// answer then stopped for length short of its `max_tokens`.
    RunOut,
}

/// The fake's judgement of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It fits; the fake counted the prompt at this many tokens.
    Fits(u64),
    /// 400 with this body.
    Refuse(String),
    /// 200 with an empty body.
    Empty,
    /// Answered after dropping the messages between the first and the last; the fake
    /// read this many tokens.
    Truncated(u64),
    /// Answered until the window filled: the fake read this many prompt tokens and wrote
    /// this many answer tokens, fewer than `max_tokens` asked.
    RanOut(u64, u64),
}

impl WindowSpec {
    /// The fake's count of the request's prompt.
    pub fn prompt_tokens(&self, body: &Value) -> u64 {
        self.message_tokens(body).iter().sum()
    }

    /// The fake's count of each message of the request.
    fn message_tokens(&self, body: &Value) -> Vec<u64> {
        let counter = Counting::O200k.counter();
        body["messages"].as_array().map_or(Vec::new(), |ms| {
            ms.iter()
                .map(|m| {
                    let text = m["content"].as_str().unwrap_or_default();
                    counter.count(text) * self.percent / 100 + FAKE_TEMPLATE_PER_MESSAGE
                })
                .collect()
        })
    }

    /// Judges `body`.
    pub fn judge(&self, body: &Value) -> Verdict {
        let prompt = self.prompt_tokens(body);
        let completion = body["max_tokens"].as_u64().unwrap_or(0);
        let streamed = body["stream"] == Value::Bool(true);
        let refusal = Verdict::Refuse(error_body(
            &format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the messages or completion.",
                self.n_ctx,
                prompt + completion
            ),
            "invalid_request_error",
            Some("messages"),
            Some("context_length_exceeded"),
        ));
        match self.overflow {
            Overflow::Refuse if prompt + completion > self.n_ctx => refusal,
            Overflow::EmptyStream if prompt >= self.n_ctx && streamed => Verdict::Empty,
            Overflow::EmptyStream if prompt >= self.n_ctx => refusal,
            Overflow::Truncate if prompt + completion > self.n_ctx => {
                let each = self.message_tokens(body);
                let kept = each.first().copied().unwrap_or(0)
                    + if each.len() > 1 {
                        each.last().copied().unwrap_or(0)
                    } else {
                        0
                    };
                Verdict::Truncated(kept)
            }
            Overflow::RunOut if prompt >= self.n_ctx => refusal,
            Overflow::RunOut if prompt + completion > self.n_ctx => {
                Verdict::RanOut(prompt, self.n_ctx - prompt)
            }
            _ => Verdict::Fits(prompt),
        }
    }
}
