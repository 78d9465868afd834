//! The stored form of an answer: what it says (message or text, tool
//! calls, finish reason, usage), never the bytes it came in. A hit is
//! rendered from it in the form the request asked for, as a live answer
//! would be: a JSON object, or the SSE events of a stream (role, content
//! deltas, finish reason, `usage` when asked for, `[DONE]`), with a fresh
//! `id` and `created`. Its usage says every prompt token was cached.
//!
//! Answers are of chat or completions only ([`Form::api`]); an
//! [`Api::Other`] answer is never read, and renders as completions only
//! for the match to be whole.
//!
//! Not here: reading a stream into one ([`super::capture`]).

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::key::Form;
use crate::prompt::body::Api;

/// The longest content delta a streamed hit sends, bytes.
const DELTA_BYTES: usize = 256;

/// An answer as stored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The model the engine named in its answer.
    pub model: String,
    /// The message's content (chat) or the text (completions).
    pub content: String,
    /// A reasoning model's reasoning (vLLM's `reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// The tool calls (chat), complete.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Why generation stopped.
    pub finish_reason: String,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// The engine's `system_fingerprint`, when it sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    /// When it was stored, Unix milliseconds (for `Age`).
    pub stored_unix_ms: u64,
}

/// One complete tool call.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Its id.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, as the engine wrote them.
    pub arguments: String,
}

impl Answer {
    /// The answer in a complete, non-streamed response body of `api`;
    /// `None` unless it is one successful choice with a finish reason and
    /// usage and without logprobs, of chat or completions.
    pub fn of_json(api: Api, body: &[u8]) -> Option<Answer> {
        let v: Value = serde_json::from_slice(body).ok()?;
        let [choice] = v["choices"].as_array()?.as_slice() else {
            return None;
        };
        if !choice["logprobs"].is_null() {
            return None;
        }
        let mut answer = Answer {
            model: v["model"].as_str()?.to_owned(),
            finish_reason: choice["finish_reason"].as_str()?.to_owned(),
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64()?,
            completion_tokens: v["usage"]["completion_tokens"].as_u64()?,
            system_fingerprint: v["system_fingerprint"].as_str().map(str::to_owned),
            ..Answer::default()
        };
        match api {
            Api::Other => return None,
            Api::Completion => answer.content = choice["text"].as_str()?.to_owned(),
            Api::Chat => {
                let message = &choice["message"];
                answer.content = message["content"].as_str().unwrap_or("").to_owned();
                answer.reasoning = message["reasoning_content"].as_str().map(str::to_owned);
                for call in message["tool_calls"].as_array().into_iter().flatten() {
                    answer.tool_calls.push(ToolCall {
                        id: call["id"].as_str()?.to_owned(),
                        name: call["function"]["name"].as_str()?.to_owned(),
                        arguments: call["function"]["arguments"].as_str()?.to_owned(),
                    });
                }
            }
        }
        Some(answer)
    }

    /// `usage` as a hit reports it: every prompt token cached.
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.prompt_tokens},
        })
    }

    /// The response body for a request of `form`, with `id` and `created`
    /// (Unix seconds): a JSON object, or a stream's events.
    pub fn render(&self, form: Form, id: &str, created: u64) -> Vec<u8> {
        if form.stream {
            self.events(form, id, created)
        } else {
            self.object(form.api, id, created)
        }
    }

    fn object(&self, api: Api, id: &str, created: u64) -> Vec<u8> {
        let mut v = match api {
            Api::Chat => {
                let mut message = json!({"role": "assistant", "content": self.content});
                if let Some(r) = &self.reasoning {
                    message["reasoning_content"] = json!(r);
                }
                if !self.tool_calls.is_empty() {
                    let calls: Vec<Value> = (self.tool_calls.iter())
                        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                        .collect();
                    message["tool_calls"] = json!(calls);
                }
                json!({
                    "id": id, "object": "chat.completion", "created": created, "model": self.model,
                    "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": self.finish_reason}],
                })
            }
            Api::Completion | Api::Other => json!({
                "id": id, "object": "text_completion", "created": created, "model": self.model,
                "choices": [{"index": 0, "text": self.content, "logprobs": null, "finish_reason": self.finish_reason}],
            }),
        };
        v["usage"] = self.usage();
        self.fingerprint(&mut v);
        serde_json::to_vec(&v).unwrap_or_default()
    }

    fn events(&self, form: Form, id: &str, created: u64) -> Vec<u8> {
        let object = match form.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completion | Api::Other => "text_completion",
        };
        let mut out = Vec::with_capacity(self.content.len() * 2 + 512);
        let mut emit = |choices: Value, usage: Option<Value>| {
            let mut chunk = json!({"id": id, "object": object, "created": created, "model": self.model, "choices": choices});
            if let Some(u) = usage {
                chunk["usage"] = u;
            }
            self.fingerprint(&mut chunk);
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(&serde_json::to_vec(&chunk).unwrap_or_default());
            out.extend_from_slice(b"\n\n");
        };
        let piece = |delta: Value, finish: Option<&str>| match form.api {
            Api::Chat => {
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
            }
            Api::Completion | Api::Other => {
                json!([{"index": 0, "text": delta, "logprobs": null, "finish_reason": finish}])
            }
        };
        if form.api == Api::Chat {
            emit(
                piece(json!({"role": "assistant", "content": ""}), None),
                None,
            );
            if let Some(r) = &self.reasoning {
                for part in split(r) {
                    emit(piece(json!({"reasoning_content": part}), None), None);
                }
            }
        }
        for part in split(&self.content) {
            let delta = match form.api {
                Api::Chat => json!({"content": part}),
                Api::Completion | Api::Other => json!(part),
            };
            emit(piece(delta, None), None);
        }
        for (i, c) in self.tool_calls.iter().enumerate() {
            let call = json!({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
            emit(piece(json!({"tool_calls": [call]}), None), None);
        }
        let end = match form.api {
            Api::Chat => json!({}),
            Api::Completion | Api::Other => json!(""),
        };
        emit(piece(end, Some(&self.finish_reason)), None);
        if form.include_usage {
            emit(json!([]), Some(self.usage()));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }

    fn fingerprint(&self, v: &mut Value) {
        if let Some(f) = &self.system_fingerprint {
            v["system_fingerprint"] = json!(f);
        }
    }
}

/// `text` in pieces of at most [`DELTA_BYTES`], cut at character
/// boundaries; at least one piece.
fn split(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while rest.len() > DELTA_BYTES {
        let mut at = DELTA_BYTES;
        while !rest.is_char_boundary(at) {
            at -= 1;
        }
        let (piece, tail) = rest.split_at(at);
        pieces.push(piece);
        rest = tail;
    }
    if !rest.is_empty() || pieces.is_empty() {
        pieces.push(rest);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::response_cache::capture::Capture;

    fn answer() -> Answer {
        Answer {
            model: "m".into(),
            content: "é".repeat(300),
            reasoning: Some("because".into()),
            tool_calls: vec![ToolCall {
                id: "call-1".into(),
                name: "lookup".into(),
                arguments: r#"{"q":"kv"}"#.into(),
            }],
            finish_reason: "tool_calls".into(),
            prompt_tokens: 12,
            completion_tokens: 5,
            system_fingerprint: Some("fp".into()),
            stored_unix_ms: 0,
        }
    }

    /// Rendered in any form, an answer reads back as itself: what a hit
    /// sends is what a live answer would have stored.
    #[test]
    fn a_rendered_answer_reads_back_the_same_in_every_form() {
        for api in [Api::Chat, Api::Completion] {
            let mut a = answer();
            if api == Api::Completion {
                (a.reasoning, a.tool_calls) = (None, Vec::new());
            }
            for stream in [false, true] {
                let form = Form {
                    api,
                    stream,
                    include_usage: true,
                };
                let body = a.render(form, "id-1", 1);
                let mut c = Capture::new(api, stream, false, 1 << 20, Some(body.len()));
                c.push(Bytes::from(body));
                assert!(c.complete(), "{api:?} stream={stream}");
                assert_eq!(c.answer(0), Ok(a.clone()), "{api:?} stream={stream}");
            }
        }
    }

    #[test]
    fn a_streamed_hit_sends_usage_only_when_asked_and_every_prompt_token_cached() {
        let form = Form {
            api: Api::Chat,
            stream: true,
            include_usage: false,
        };
        let text = String::from_utf8(answer().render(form, "x", 1)).unwrap();
        assert!(!text.contains("\"usage\""));
        assert!(text.ends_with("data: [DONE]\n\n"));
        let json = answer().render(
            Form {
                stream: false,
                ..form
            },
            "x",
            1,
        );
        let v: Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 12);
        assert_eq!(v["usage"]["total_tokens"], 17);
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "lookup"
        );
    }
}
