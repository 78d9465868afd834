//! Reads an engine's answer as it streams to the client, into the
//! [`Answer`] to store: a JSON body whole, or a stream event by event.
//! Only a complete successful answer comes out: one choice, a finish
//! reason, usage, `[DONE]` for a stream, no error event, within
//! `responseCache.maxEntryBytes`.
//!
//! A stream is passed on event by event (an event's bytes are held until
//! its blank line arrives, which a client could not use sooner anyway).
//! When the router added `stream_options.include_usage`, the usage-only
//! event is taken out, so the client gets what it asked for. An event that
//! grows past the bound without ending turns the capture off and the rest
//! passes as it comes.
//!
//! Server-sent events are framed here rather than by a crate: the events
//! must be passed on byte for byte, and the framing is one rule (an event
//! ends at a blank line) over the `data:` lines engines write.
//!
//! Not here: the response's status and headers ([`super`] stores only a
//! 200 answer).

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use super::answer::{Answer, ToolCall};
use crate::prompt::body::Api;

/// How an answer is being read.
#[derive(Debug)]
pub struct Capture {
    api: Api,
    sse: bool,
    strip_usage: bool,
    max: usize,
    /// A stream's unfinished event, or a JSON body so far.
    pending: BytesMut,
    /// The JSON body's declared length.
    length: Option<usize>,
    answer: Answer,
    usage: bool,
    finished: bool,
    done: bool,
    /// Not storable: too large, an error, more than one choice.
    spoiled: bool,
    /// Over the bound.
    too_large: bool,
    /// Passing bytes as they come (a stream's event outgrew the bound).
    passing: bool,
}

impl Capture {
    /// A capture of an answer of `api`, `sse` or JSON of `length` (when
    /// declared), storing at most `max` bytes; `strip_usage` takes the
    /// usage event out of a stream.
    pub fn new(api: Api, sse: bool, strip_usage: bool, max: usize, length: Option<usize>) -> Self {
        Capture {
            api,
            sse,
            strip_usage: strip_usage && sse,
            max,
            pending: BytesMut::new(),
            length,
            answer: Answer::default(),
            usage: false,
            finished: false,
            done: false,
            spoiled: length.is_some_and(|n| n > max),
            too_large: length.is_some_and(|n| n > max),
            passing: false,
        }
    }

    /// Reads `data`, the next bytes of the body; returns what to send the
    /// client now.
    pub fn push(&mut self, data: Bytes) -> Bytes {
        if !self.sse {
            if !self.spoiled {
                if self.pending.len() + data.len() > self.max {
                    self.spoiled = true;
                    self.too_large = true;
                    self.pending = BytesMut::new();
                } else {
                    self.pending.extend_from_slice(&data);
                }
            }
            return data;
        }
        if self.passing {
            return data;
        }
        self.pending.extend_from_slice(&data);
        let mut out = BytesMut::new();
        while let Some((end, sep)) = event_end(&self.pending) {
            let event = self.pending.split_to(end + sep).freeze();
            if self.event(&event[..end]) {
                out.extend_from_slice(&event);
            }
        }
        if self.pending.len() > self.max {
            // An event without end: stop reading, pass what is held.
            self.spoiled = true;
            self.too_large = true;
            self.passing = true;
            out.extend_from_slice(&self.pending.split());
        }
        out.freeze()
    }

    /// Whether the whole answer has been read: `[DONE]`, or the JSON
    /// body's declared length.
    pub fn complete(&self) -> bool {
        if self.sse {
            self.done
        } else {
            self.length.is_some_and(|n| self.pending.len() == n)
        }
    }

    /// Whether the answer can no longer be stored, however it ends.
    pub fn spoiled(&self) -> bool {
        self.spoiled
    }

    /// What is left to send when the body ended (a stream's unfinished
    /// last event).
    pub fn rest(&mut self) -> Bytes {
        if self.sse {
            self.pending.split().freeze()
        } else {
            Bytes::new()
        }
    }

    /// The answer, if the body ended complete and storable; else why
    /// not: `too_large` or `incomplete`.
    pub fn answer(&mut self, stored_unix_ms: u64) -> Result<Answer, &'static str> {
        if self.too_large {
            return Err("too_large");
        }
        let answer = if self.spoiled {
            None
        } else if self.sse {
            (self.done && self.finished && self.usage).then(|| std::mem::take(&mut self.answer))
        } else {
            Answer::of_json(self.api, &self.pending)
        };
        let mut answer = answer.ok_or("incomplete")?;
        answer.stored_unix_ms = stored_unix_ms;
        Ok(answer)
    }

    /// Reads one event (without its blank line); returns whether the
    /// client gets it.
    fn event(&mut self, event: &[u8]) -> bool {
        let Some(data) = data(event) else {
            return true;
        };
        if data == b"[DONE]" {
            self.done = true;
            return true;
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(&data) else {
            self.spoiled = true;
            return true;
        };
        if chunk.get("error").is_some() {
            self.spoiled = true;
            return true;
        }
        if let Some(model) = chunk["model"].as_str()
            && self.answer.model.is_empty()
        {
            model.clone_into(&mut self.answer.model);
        }
        if let Some(f) = chunk["system_fingerprint"].as_str() {
            self.answer.system_fingerprint = Some(f.to_owned());
        }
        let usage = &chunk["usage"];
        if let (Some(p), Some(c)) = (
            usage["prompt_tokens"].as_u64(),
            usage["completion_tokens"].as_u64(),
        ) {
            (self.answer.prompt_tokens, self.answer.completion_tokens) = (p, c);
            self.usage = true;
        }
        let choices = chunk["choices"].as_array().map_or(&[][..], Vec::as_slice);
        match choices {
            [] => !self.strip_usage || usage.is_null(),
            [choice] if choice["index"].as_u64().unwrap_or(0) == 0 => {
                self.choice(choice);
                true
            }
            _ => {
                self.spoiled = true;
                true
            }
        }
    }

    /// Reads one streamed choice.
    fn choice(&mut self, choice: &Value) {
        if !choice["logprobs"].is_null() {
            self.spoiled = true;
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            f.clone_into(&mut self.answer.finish_reason);
            self.finished = true;
        }
        let a = &mut self.answer;
        match self.api {
            // Never stored: only chat and completions are cached.
            Api::Other => self.spoiled = true,
            Api::Completion => a.content.push_str(choice["text"].as_str().unwrap_or("")),
            Api::Chat => {
                let delta = &choice["delta"];
                a.content.push_str(delta["content"].as_str().unwrap_or(""));
                if let Some(r) = delta["reasoning_content"].as_str() {
                    a.reasoning.get_or_insert_default().push_str(r);
                }
                for call in delta["tool_calls"].as_array().into_iter().flatten() {
                    let i = call["index"].as_u64().unwrap_or(0) as usize;
                    if i > a.tool_calls.len() {
                        self.spoiled = true;
                        return;
                    }
                    if i == a.tool_calls.len() {
                        a.tool_calls.push(ToolCall::default());
                    }
                    let c = &mut a.tool_calls[i];
                    if let Some(id) = call["id"].as_str() {
                        id.clone_into(&mut c.id);
                    }
                    let function = &call["function"];
                    c.name.push_str(function["name"].as_str().unwrap_or(""));
                    c.arguments
                        .push_str(function["arguments"].as_str().unwrap_or(""));
                }
            }
        }
        let size = a.content.len()
            + a.reasoning.as_ref().map_or(0, String::len)
            + (a.tool_calls.iter())
                .map(|c| c.id.len() + c.name.len() + c.arguments.len())
                .sum::<usize>();
        if size > self.max {
            self.spoiled = true;
            self.too_large = true;
            self.answer = Answer::default();
        }
    }
}

/// Where the first event in `buf` ends: its length and its blank line's.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = memchr::memmem::find(buf, b"\n\n").map(|i| (i, 2));
    let crlf = memchr::memmem::find(buf, b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// An event's `data:` lines joined, if it has any.
fn data(event: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let d = out.get_or_insert_with(Vec::new);
            if !d.is_empty() {
                d.push(b'\n');
            }
            d.extend_from_slice(rest);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(delta: &str, finish: Option<&str>) -> String {
        let v = serde_json::json!({"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {"content": delta}, "logprobs": null, "finish_reason": finish}]});
        format!("data: {v}\n\n")
    }

    const USAGE: &str = "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}}\n\n";

    fn stream(parts: &[&str]) -> String {
        parts.concat()
    }

    /// Feeds `body` cut into pieces of `step` bytes; returns what the
    /// client got and the capture.
    fn feed(body: &str, step: usize, strip: bool, max: usize) -> (String, Capture) {
        let mut c = Capture::new(Api::Chat, true, strip, max, None);
        let mut out = Vec::new();
        for piece in body.as_bytes().chunks(step) {
            out.extend_from_slice(&c.push(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&c.rest());
        (String::from_utf8(out).unwrap(), c)
    }

    #[test]
    fn a_complete_stream_is_read_whatever_its_framing() {
        let body = stream(&[
            &chunk("Hel", None),
            &chunk("lo", Some("stop")),
            USAGE,
            "data: [DONE]\n\n",
        ]);
        for step in [1, 3, 7, body.len()] {
            let (out, mut c) = feed(&body, step, false, 1 << 20);
            assert_eq!(out, body, "passed on unchanged");
            assert!(c.complete());
            let a = c.answer(5).unwrap();
            assert_eq!(
                (a.content.as_str(), a.finish_reason.as_str()),
                ("Hello", "stop")
            );
            assert_eq!(
                (a.prompt_tokens, a.completion_tokens, a.stored_unix_ms),
                (7, 2, 5)
            );
        }
        let crlf = body.replace("\n\n", "\r\n\r\n");
        let (out, mut c) = feed(&crlf, 5, false, 1 << 20);
        assert_eq!(out, crlf);
        assert_eq!(c.answer(0).unwrap().content, "Hello");
    }

    #[test]
    fn the_usage_the_router_asked_for_is_taken_out() {
        let body = stream(&[&chunk("Hi", Some("stop")), USAGE, "data: [DONE]\n\n"]);
        let (out, mut c) = feed(&body, 4, true, 1 << 20);
        assert_eq!(
            out,
            stream(&[&chunk("Hi", Some("stop")), "data: [DONE]\n\n"])
        );
        assert_eq!(c.answer(0).unwrap().prompt_tokens, 7);
    }

    #[test]
    fn only_complete_successful_answers_come_out() {
        let truncated = stream(&[&chunk("Hel", None), &chunk("lo", Some("stop")), USAGE]);
        assert_eq!(
            feed(&truncated, 8, false, 1 << 20).1.answer(0),
            Err("incomplete")
        );
        let no_usage = stream(&[&chunk("Hi", Some("stop")), "data: [DONE]\n\n"]);
        assert_eq!(
            feed(&no_usage, 8, false, 1 << 20).1.answer(0),
            Err("incomplete")
        );
        let error = stream(&[
            &chunk("Hi", None),
            "data: {\"error\":{\"message\":\"broke\"}}\n\n",
            USAGE,
            "data: [DONE]\n\n",
        ]);
        assert_eq!(
            feed(&error, 8, false, 1 << 20).1.answer(0),
            Err("incomplete")
        );
        let two = "data: {\"choices\":[{\"index\":0,\"delta\":{}},{\"index\":1,\"delta\":{}}]}\n\n";
        let body = stream(&[two, &chunk("Hi", Some("stop")), USAGE, "data: [DONE]\n\n"]);
        assert_eq!(
            feed(&body, 8, false, 1 << 20).1.answer(0),
            Err("incomplete")
        );
        let long = stream(&[
            &chunk(&"x".repeat(300), Some("stop")),
            USAGE,
            "data: [DONE]\n\n",
        ]);
        let (out, mut c) = feed(&long, 64, false, 200);
        assert_eq!(out, long, "a large answer is passed on whole");
        assert_eq!(c.answer(0), Err("too_large"));
    }

    #[test]
    fn a_json_answer_is_complete_at_its_declared_length() {
        let body = br#"{"id":"x","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi","tool_calls":[{"id":"t1","type":"function","function":{"name":"f","arguments":"{}"}}]},"logprobs":null,"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        let mut c = Capture::new(Api::Chat, false, false, 1 << 20, Some(body.len()));
        assert_eq!(c.push(Bytes::from_static(&body[..10])), &body[..10]);
        assert!(!c.complete());
        c.push(Bytes::from_static(&body[10..]));
        assert!(c.complete());
        let a = c.answer(0).unwrap();
        assert_eq!(a.tool_calls[0].name, "f");
        assert_eq!(a.finish_reason, "tool_calls");
        let mut big = Capture::new(Api::Chat, false, false, 16, Some(body.len()));
        big.push(Bytes::from_static(body));
        assert_eq!(big.answer(0), Err("too_large"));
    }
}
