//! Request bodies of OpenAI's completion APIs, read field by field so that
//! every error names the parameter, and parameters this server does not
//! implement are refused rather than ignored.

use leanstream_runtime::generate::{ChatMessage, SamplerConfig};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::ServerError;

/// What both endpoints take besides the prompt.
#[derive(Debug, Clone)]
pub struct Generation {
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage alone.
    pub include_usage: bool,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub generation: Generation,
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: String,
    pub generation: Generation,
}

/// Accepted by both endpoints; the penalties, `logprobs` and `echo` only
/// with values that ask for nothing.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
];

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ServerError> {
        let m = object(body)?;
        check_fields(&m, &["messages", "max_completion_tokens"])?;
        let messages: Vec<Value> = get(&m, "messages")?.ok_or_else(|| missing("messages"))?;
        if messages.is_empty() {
            return Err(ServerError::bad_param(
                "messages",
                "'messages' is empty: a chat needs at least one message",
            ));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, v)| message(i, v))
            .collect::<Result<Vec<_>, _>>()?;
        let mut generation = generation(&m)?;
        if let Some(n) = get::<u64>(&m, "max_completion_tokens")? {
            generation.max_tokens = Some(positive("max_completion_tokens", n)?);
        }
        Ok(Self { messages, generation })
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ServerError> {
        let m = object(body)?;
        check_fields(&m, &["prompt", "echo"])?;
        let prompt = match m.get("prompt") {
            None | Some(Value::Null) => return Err(missing("prompt")),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or_default().to_string(),
            Some(Value::Array(_)) => {
                return Err(ServerError::bad_param(
                    "prompt",
                    "'prompt': only one prompt string per request is supported",
                ))
            }
            Some(_) => return Err(ServerError::bad_param("prompt", "'prompt' must be a string")),
        };
        if prompt.is_empty() {
            return Err(ServerError::bad_param("prompt", "'prompt' is empty"));
        }
        if get::<bool>(&m, "echo")? == Some(true) {
            return Err(unsupported("echo", "true"));
        }
        Ok(Self {
            prompt,
            generation: generation(&m)?,
        })
    }
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ServerError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ServerError::bad("the request body must be a JSON object")),
        Err(e) => Err(ServerError::bad(format!("the request body is not valid JSON: {e}"))),
    }
}

fn check_fields(m: &Map<String, Value>, own: &[&str]) -> Result<(), ServerError> {
    match m
        .keys()
        .find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        Some(k) => Err(ServerError::bad_param(k, format!("unsupported parameter '{k}'"))),
        None => Ok(()),
    }
}

/// Field `key`, absent or null as `None`, a wrong type as an error naming it.
fn get<T: DeserializeOwned>(m: &Map<String, Value>, key: &str) -> Result<Option<T>, ServerError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v)
            .map(Some)
            .map_err(|e| ServerError::bad_param(key, format!("'{key}': {e}"))),
    }
}

fn missing(key: &str) -> ServerError {
    ServerError::bad_param(key, format!("'{key}' is required"))
}

fn unsupported(key: &str, value: &str) -> ServerError {
    ServerError::bad_param(key, format!("'{key}' = {value} is not supported by this server"))
}

fn positive(key: &str, n: u64) -> Result<usize, ServerError> {
    if n == 0 {
        return Err(ServerError::bad_param(key, format!("'{key}' must be at least 1")));
    }
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

fn in_range(key: &str, v: Option<f32>, lo: f32, hi: f32, lo_open: bool) -> Result<Option<f32>, ServerError> {
    match v {
        Some(x) if !(x.is_finite() && x <= hi && (x > lo || (!lo_open && x == lo))) => {
            let open = if lo_open { "(" } else { "[" };
            Err(ServerError::bad_param(
                key,
                format!("'{key}' = {x} is outside {open}{lo}, {hi}]"),
            ))
        }
        v => Ok(v),
    }
}

fn generation(m: &Map<String, Value>) -> Result<Generation, ServerError> {
    get::<String>(m, "model")?;
    get::<String>(m, "user")?;
    if let Some(n) = get::<u64>(m, "n")? {
        if n != 1 {
            return Err(unsupported("n", &n.to_string()));
        }
    }
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(p) = get::<f32>(m, key)? {
            if p != 0.0 {
                return Err(unsupported(key, &p.to_string()));
            }
        }
    }
    // Chat takes a boolean, completions an integer count; either asks for
    // log probabilities unless false or 0.
    match m.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Number(n)) if n.as_u64() == Some(0) => {}
        Some(v) => return Err(unsupported("logprobs", &v.to_string())),
    }
    let stream = get::<bool>(m, "stream")?.unwrap_or(false);
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct StreamOptions {
        #[serde(default)]
        include_usage: bool,
    }
    let include_usage = match get::<StreamOptions>(m, "stream_options")? {
        Some(_) if !stream => {
            return Err(ServerError::bad_param(
                "stream_options",
                "'stream_options' is only allowed with 'stream': true",
            ))
        }
        Some(o) => o.include_usage,
        None => false,
    };
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(v) => get::<Vec<String>>(m, "stop")?.filter(|s| s.len() <= 4).ok_or_else(|| {
            ServerError::bad_param("stop", format!("'stop' must be a string or up to 4 strings, not {v}"))
        })?,
    };
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ServerError::bad_param("stop", "'stop' strings must not be empty"));
    }
    let max_tokens = get::<u64>(m, "max_tokens")?
        .map(|n| positive("max_tokens", n))
        .transpose()?;
    // OpenAI's defaults: temperature 1, top_p 1; top_k (an extension, as
    // llama-server's) off.
    let temperature = in_range("temperature", get(m, "temperature")?, 0.0, 2.0, false)?.unwrap_or(1.0);
    let top_p = in_range("top_p", get(m, "top_p")?, 0.0, 1.0, true)?.unwrap_or(1.0);
    let top_k = get::<u32>(m, "top_k")?.unwrap_or(0) as usize;
    let seed = match m.get("seed") {
        // Any 64-bit integer, signed or not, names a seed.
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
            n.as_u64().unwrap_or_else(|| n.as_i64().unwrap_or(0) as u64)
        }
        Some(Value::Null) | None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        Some(v) => {
            return Err(ServerError::bad_param(
                "seed",
                format!("'seed' must be an integer, not {v}"),
            ))
        }
    };
    Ok(Generation {
        max_tokens,
        sampling: SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
        },
        stop,
        stream,
        include_usage,
    })
}

/// Message `i` of `messages`: a role and text content (a string, or text parts).
fn message(i: usize, v: &Value) -> Result<ChatMessage, ServerError> {
    let param = format!("messages[{i}]");
    let bad = |what: String| ServerError::bad_param(&param, format!("'{param}': {what}"));
    let Value::Object(m) = v else {
        return Err(bad("must be an object with 'role' and 'content'".into()));
    };
    if let Some(k) = m.keys().find(|k| !["role", "content", "name"].contains(&k.as_str())) {
        return Err(bad(format!("unsupported field '{k}'")));
    }
    let role = match m.get("role") {
        Some(Value::String(r)) => match r.as_str() {
            "system" | "user" | "assistant" => r.clone(),
            // OpenAI's newer name for system instructions.
            "developer" => "system".to_string(),
            other => {
                return Err(bad(format!(
                    "role '{other}' is not one of system, developer, user, assistant"
                )))
            }
        },
        _ => return Err(bad("'role' is required and must be a string".into())),
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text += t,
                    (Some(kind), _) if kind != "text" => {
                        return Err(bad(format!(
                            "content parts of type '{kind}' are not supported; only text"
                        )))
                    }
                    _ => return Err(bad("a content part must be {\"type\": \"text\", \"text\": ...}".into())),
                }
            }
            text
        }
        _ => {
            return Err(bad(
                "'content' is required and must be a string or a list of text parts".into(),
            ))
        }
    };
    Ok(ChatMessage { role, content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(e: ServerError) -> Option<String> {
        match e {
            ServerError::BadRequest { param, .. } => param,
            other => panic!("not a bad request: {other}"),
        }
    }

    #[test]
    fn a_chat_request_reads_its_fields() {
        let r = ChatRequest::parse(
            br#"{"model":"x","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
                "temperature":0,"top_p":0.5,"top_k":3,"seed":-1,"stop":["\n"],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true},"n":1}"#,
        )
        .unwrap();
        assert_eq!(
            r.messages,
            vec![ChatMessage::new("system", "s"), ChatMessage::new("user", "ab")]
        );
        let g = r.generation;
        assert_eq!(
            (g.max_tokens, g.stop, g.stream, g.include_usage),
            (Some(7), vec!["\n".to_string()], true, true)
        );
        assert_eq!(
            (
                g.sampling.temperature,
                g.sampling.top_p,
                g.sampling.top_k,
                g.sampling.seed
            ),
            (0.0, 0.5, 3, u64::MAX)
        );
    }

    #[test]
    fn bad_requests_name_the_parameter() {
        let cases: &[(&[u8], Option<&str>)] = &[
            (b"{", None),
            (b"[1]", None),
            (b"{\"messages\":[]}", Some("messages")),
            (b"{}", Some("messages")),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"temperature":"hot"}"#,
                Some("temperature"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"temperature":3}"#,
                Some("temperature"),
            ),
            (br#"{"messages":[{"role":"user","content":"a"}],"n":2}"#, Some("n")),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"tools":[]}"#,
                Some("tools"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"max_tokens":0}"#,
                Some("max_tokens"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"max_tokens":-5}"#,
                Some("max_tokens"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"stop":[1]}"#,
                Some("stop"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"stream_options":{}}"#,
                Some("stream_options"),
            ),
            (br#"{"messages":[{"role":"robot","content":"a"}]}"#, Some("messages[0]")),
            (br#"{"messages":[{"role":"user"}]}"#, Some("messages[0]")),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                Some("messages[0]"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"presence_penalty":1}"#,
                Some("presence_penalty"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"logprobs":true}"#,
                Some("logprobs"),
            ),
        ];
        for (body, param) in cases {
            let e = ChatRequest::parse(body).expect_err(&String::from_utf8_lossy(body));
            assert_eq!(param_of(e).as_deref(), *param, "{}", String::from_utf8_lossy(body));
        }
        // Invalid UTF-8 inside a string is a JSON error, not a panic.
        assert!(ChatRequest::parse(b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}").is_err());
    }

    #[test]
    fn a_completion_takes_one_prompt() {
        let r = CompletionRequest::parse(br#"{"prompt":["Once"],"logprobs":0,"echo":false}"#).unwrap();
        assert_eq!(r.prompt, "Once");
        assert_eq!(r.generation.sampling.temperature, 1.0);
        for body in [
            &br#"{"prompt":""}"#[..],
            br#"{"prompt":["a","b"]}"#,
            br#"{"prompt":3}"#,
            br#"{"prompt":"a","echo":true}"#,
        ] {
            assert!(CompletionRequest::parse(body).is_err());
        }
    }
}
