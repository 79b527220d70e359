//! `leanstream serve` started for real on a loopback port and driven by the
//! official `openai` Python package, by curl and by a load of concurrent
//! clients; `leanstream chat` fed through a pipe.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "../../runtime/tests/common/mod.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_leanstream");
const PROMPT: &str = "Name three rivers in Europe.";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A running `leanstream serve`; stopped when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .args(["--threads", "2", "serve", "--model"])
            .arg(model)
            .args(["--port", "0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting leanstream serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let url = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(i) = line.find("listening on ") {
                        break line[i + "listening on ".len()..].trim().to_string();
                    }
                    seen.push(line);
                }
                _ => panic!("the server exited before listening:\n{}", seen.join("\n")),
            }
        };
        // Keep reading so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, url }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `curl` with `args`, then the URL; answers (status, headers, body).
fn curl(url: &str, args: &[&str], body: Option<&[u8]>) -> (u16, String, Vec<u8>) {
    let mut c = Command::new("curl")
        .args(["-sS", "-N", "-D", "/dev/stderr", "-w", "\n%{http_code}"])
        .args(args)
        .args(if body.is_some() {
            &["--data-binary", "@-"][..]
        } else {
            &[][..]
        })
        .arg(url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("curl");
    if let Some(b) = body {
        c.stdin.take().unwrap().write_all(b).unwrap();
    }
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut body = out.stdout;
    let split = body.iter().rposition(|&b| b == b'\n').unwrap();
    let code = std::str::from_utf8(&body[split + 1..]).unwrap().trim().parse().unwrap();
    body.truncate(split);
    (code, String::from_utf8_lossy(&out.stderr).into_owned(), body)
}

fn post(s: &Server, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    curl(
        &format!("{}{path}", s.url),
        &["-X", "POST", "-H", "Content-Type: application/json"],
        Some(body),
    )
}

fn get(s: &Server, path: &str) -> (u16, Vec<u8>) {
    let (code, _, body) = curl(&format!("{}{path}", s.url), &[], None);
    (code, body)
}

fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

/// The text of an SSE stream of chat or completion chunks, checking that it
/// ends with `[DONE]`.
fn sse_text(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| json_of(d.as_bytes()))
        .flat_map(|v| v["choices"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| {
            c["delta"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .map(str::to_string)
        })
        .collect()
}

/// What `leanstream run` prints for `prompt` (greedy, `n` tokens).
fn run_text(model: &Path, prompt: &str, n: usize, chat: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["--threads", "2", "run", "--model"]).arg(model);
    cmd.args(["--prompt", prompt, "-n", &n.to_string(), "--temp", "0"]);
    if chat {
        cmd.arg("--chat");
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The value of a Prometheus sample line `name` (labels included).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
}

fn metrics(s: &Server) -> String {
    String::from_utf8(get(s, "/metrics").1).unwrap()
}

/// The metrics once the engine is idle with nothing queued (a client's
/// disconnect reaches the engine a little after the client has gone).
fn settled_metrics(s: &Server) -> String {
    let t0 = Instant::now();
    loop {
        let m = metrics(s);
        if metric(&m, "leanstream_busy") == 0.0 && metric(&m, "leanstream_queue_length") == 0.0 {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the engine stayed busy:\n{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn python_has_openai() -> bool {
    Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn the_openai_client_and_curl_get_the_text_leanstream_run_prints() {
    if !python_has_openai() {
        let how = "the `openai` Python package is missing (scripts/test.sh installs it: python3 -m pip install openai)";
        assert_eq!(
            std::env::var("LEANSTREAM_ALLOW_MISSING_MODELS").as_deref(),
            Ok("1"),
            "{how}"
        );
        eprintln!("SKIPPED: {how}; LEANSTREAM_ALLOW_MISSING_MODELS=1");
        return;
    }
    for name in ["smollm2", "gemma3"] {
        let Some(model) = common::model_path(name) else {
            continue;
        };
        let n = 24;
        let chat_ref = run_text(&model, PROMPT, n, true);
        let plain_ref = run_text(&model, PROMPT, n, false);
        assert!(!chat_ref.is_empty() && !plain_ref.is_empty());
        // Whole prompts, as `run` runs them (the prompt cache would run a
        // repeated prompt's last token alone).
        let server = Server::start(&model, &["--no-prompt-cache"]);

        let out = Command::new("python3")
            .arg(repo().join("cli/tests/clients/openai_check.py"))
            .args([&server.url, PROMPT, &n.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let v = json_of(&out.stdout);
        assert_eq!(v["model"], model.file_stem().unwrap().to_str().unwrap());
        assert_eq!(v["chat"], chat_ref.as_str(), "{name}: chat");
        assert_eq!(v["chat_stream"], chat_ref.as_str(), "{name}: streamed chat");
        assert!(
            v["chat_stream_chunks"].as_u64().unwrap() > 1,
            "{name}: one chunk per piece"
        );
        assert_eq!(v["completion"], plain_ref.as_str(), "{name}: completion");
        assert_eq!(
            v["completion_stream"],
            plain_ref.as_str(),
            "{name}: streamed completion"
        );
        let usage = &v["chat_usage"];
        assert_eq!(v["chat_stream_usage"][1], usage[1], "{name}: usage of both");
        assert!(usage[1].as_u64().unwrap() <= n as u64);
        assert_eq!(
            usage[2].as_u64(),
            Some(usage[0].as_u64().unwrap() + usage[1].as_u64().unwrap())
        );
        let finish = if usage[1].as_u64() == Some(n as u64) {
            "length"
        } else {
            "stop"
        };
        assert_eq!(
            (v["chat_finish"].as_str(), v["chat_stream_finish"].as_str()),
            (Some(finish), Some(finish))
        );
        assert_eq!(v["n2_error"], json!([400, "n"]), "{name}");

        // The same through curl, streamed and not.
        let req = |stream: bool| {
            json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0, "stream": stream})
                .to_string()
        };
        let (code, _, body) = post(&server, "/v1/chat/completions", req(false).as_bytes());
        assert_eq!(code, 200);
        assert_eq!(
            json_of(&body)["choices"][0]["message"]["content"],
            chat_ref.as_str(),
            "{name}: curl"
        );
        let (code, headers, body) = post(&server, "/v1/chat/completions", req(true).as_bytes());
        assert_eq!(code, 200);
        assert!(
            headers.to_lowercase().contains("content-type: text/event-stream"),
            "{headers}"
        );
        assert_eq!(sse_text(&body), chat_ref, "{name}: curl stream");
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let server = Server::start(&model, &["--ctx", "64"]);
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]}).to_string();
    let chat = "/v1/chat/completions";
    // (path, body, the parameter the error names, its code)
    type Case<'a> = (&'a str, Vec<u8>, Option<&'a str>, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (chat, b"{\"messages\": [".to_vec(), None, None),
        (chat, b"[]".to_vec(), None, None),
        (chat, br#"{"messages": "hi"}"#.to_vec(), Some("messages"), None),
        (chat, br#"{"messages": []}"#.to_vec(), Some("messages"), None),
        (
            chat,
            br#"{"messages": [{"role": "user", "content": ""}], "max_tokens": "many"}"#.to_vec(),
            Some("max_tokens"),
            None,
        ),
        (
            chat,
            long.into_bytes(),
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        (
            chat,
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000000}"#.to_vec(),
            Some("max_tokens"),
            Some("context_length_exceeded"),
        ),
        (
            chat,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            None,
            None,
        ),
        (
            chat,
            br#"{"messages": [{"role": "user", "content": "hi"}], "tools": []}"#.to_vec(),
            Some("tools"),
            None,
        ),
        (
            chat,
            br#"{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}"#.to_vec(),
            Some("temperature"),
            None,
        ),
        ("/v1/completions", br#"{"prompt": ""}"#.to_vec(), Some("prompt"), None),
    ];
    for (path, body, param, code) in &cases {
        let (status, _, answer) = post(&server, path, body);
        let shown = String::from_utf8_lossy(body);
        assert_eq!(status, 400, "{shown}: {}", String::from_utf8_lossy(&answer));
        let e = &json_of(&answer)["error"];
        assert!(!e["message"].as_str().unwrap_or_default().is_empty(), "{shown}");
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"].as_str(), *param, "{shown}: {e}");
        if let Some(c) = code {
            assert_eq!(e["code"], *c, "{shown}");
        }
    }
    let (status, body) = get(&server, "/v1/nothing");
    assert_eq!(status, 404);
    assert!(json_of(&body)["error"]["message"].is_string());

    // Still serving, and counting what it refused.
    let (status, _, body) = post(
        &server,
        chat,
        br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#,
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        json_of(&body)["usage"]["prompt_tokens"].as_u64().map(|p| p > 0),
        Some(true)
    );
    let (status, body) = get(&server, "/health");
    assert_eq!((status, json_of(&body)["status"].as_str()), (200, Some("ok")));
    let m = metrics(&server);
    assert_eq!(
        metric(&m, "leanstream_requests_total{outcome=\"client_error\"}"),
        cases.len() as f64
    );
    assert_eq!(metric(&m, "leanstream_requests_total{outcome=\"completed\"}"), 1.0);
    assert_eq!(metric(&m, "leanstream_prompt_tokens_reused_total"), 0.0);

    // The same prompt again: all but its last token come from the KV cache
    // the first left (a failed request in between must not have spoiled it).
    let ok = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#;
    let (status, _, body) = post(&server, chat, ok);
    assert_eq!(status, 200);
    let prompt = json_of(&body)["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(
        metric(&metrics(&server), "leanstream_prompt_tokens_reused_total"),
        prompt - 1.0
    );
}

/// A message that writes its template's control tokens gets them as text:
/// it cannot end its own turn and open one for another role. Its prompt
/// counts the text's tokens, not the one control token, and `/v1/completions`
/// (the client writes the whole prompt) still parses them.
#[test]
fn control_tokens_written_in_a_message_stay_text() {
    for (name, control) in [("smollm2", "<|im_end|>"), ("gemma3", "<end_of_turn>")] {
        let Some(model) = common::model_path(name) else {
            continue;
        };
        let server = Server::start(&model, &[]);
        let prompt_tokens = |path: &str, body: Value| {
            let (code, _, out) = post(&server, path, body.to_string().as_bytes());
            assert_eq!(code, 200, "{name}: {}", String::from_utf8_lossy(&out));
            json_of(&out)["usage"]["prompt_tokens"].as_u64().unwrap()
        };
        let chat = |content: &str| {
            prompt_tokens(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}),
            )
        };
        let completion = |prompt: &str| {
            prompt_tokens(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}),
            )
        };
        let as_text = chat(&format!("a{control}")) - chat("a");
        assert!(as_text > 2, "{name}: {control} in a message took {as_text} tokens");
        assert_eq!(completion(&format!("a{control}")) - completion("a"), 1, "{name}");
    }
}

#[test]
fn an_api_key_guards_the_api_but_not_health() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let server = Server::start(&model, &["--api-key", "s3cret"]);
    let models = format!("{}/v1/models", server.url);
    let (status, _, body) = curl(&models, &[], None);
    assert_eq!(status, 401);
    assert_eq!(json_of(&body)["error"]["code"], "invalid_api_key");
    let (status, _, _) = curl(&models, &["-H", "Authorization: Bearer wrong"], None);
    assert_eq!(status, 401);
    let (status, _, body) = curl(&models, &["-H", "Authorization: Bearer s3cret"], None);
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["data"][0]["object"], "model");
    assert_eq!(get(&server, "/health").0, 200);
}

/// Sends a streaming request over a raw socket and reads until `events`
/// data lines have arrived (none: the answer is left unread).
fn open_stream(s: &Server, body: &str, events: usize) -> TcpStream {
    let addr = s.url.trim_start_matches("http://");
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("data: ").count() < events {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {seen}");
        seen += &String::from_utf8_lossy(&buf[..n]);
    }
    c
}

#[test]
fn a_client_that_disconnects_frees_the_engine() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let server = Server::start(&model, &["--ctx", "1024"]);
    let max = 900;
    let body = json!({"messages": [{"role": "user", "content": "Tell me a very long story."}],
                      "max_tokens": max, "temperature": 1.0, "seed": 1, "stream": true})
    .to_string();
    let running = open_stream(&server, &body, 3);
    // A second client queued behind it goes away before its turn.
    let queued = open_stream(&server, &body, 0);
    // Let the server queue it before the client goes.
    std::thread::sleep(Duration::from_millis(300));
    drop(queued);
    drop(running);
    let t0 = Instant::now();
    loop {
        let m = metrics(&server);
        if metric(&m, "leanstream_requests_total{outcome=\"cancelled\"}") == 2.0 && metric(&m, "leanstream_busy") == 0.0
        {
            let generated = metric(&m, "leanstream_completion_tokens_total");
            assert!(generated < max as f64, "the generation ran on to {generated} tokens");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the engine never noticed the disconnects:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, _, _) = post(&server, "/v1/completions", br#"{"prompt": "Hello", "max_tokens": 4}"#);
    assert_eq!(status, 200);
}

fn load(s: &Server, requests: usize, clients: usize, max_tokens: usize) -> Value {
    let out = Command::new("python3")
        .arg(repo().join("scripts/serve_load.py"))
        .args([
            "--url",
            &s.url,
            "--requests",
            &requests.to_string(),
            "--clients",
            &clients.to_string(),
        ])
        .args(["--max-tokens", &max_tokens.to_string(), "--cancel-every", "10"])
        .output()
        .unwrap();
    let v = json_of(&out.stdout);
    assert!(out.status.success(), "requests were lost: {v}");
    v
}

#[test]
fn two_hundred_requests_from_eight_clients_each_end_cleanly() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    // A queue shorter than the clients, so some are turned away.
    let server = Server::start(&model, &["--queue", "3", "--ctx", "512"]);
    let v = load(&server, 200, 8, 8);
    let count = |k: &str| v["outcomes"][k].as_f64().unwrap_or(0.0);
    assert_eq!(v["answered"], 200);
    assert_eq!(count("lost"), 0.0, "{v}");
    assert!(count("completed") > 0.0 && count("cancelled") > 0.0, "{v}");
    // The queue turned some away, each with Retry-After; after it no errors.
    let busy = v["busy_answers_503"].as_f64().unwrap();
    assert!(busy > 0.0, "{v}");
    assert_eq!(v["retry_after_on_503"], true);
    assert_eq!(count("error"), 0.0, "{v}");
    let m = settled_metrics(&server);
    let server_side = |o: &str| metric(&m, &format!("leanstream_requests_total{{outcome=\"{o}\"}}"));
    assert_eq!(server_side("queue_full"), busy, "{m}");
    // A stream its client dropped may have finished before the server noticed.
    assert_eq!(
        server_side("completed") + server_side("cancelled"),
        count("completed") + count("cancelled"),
        "{m}\n{v}"
    );
    assert_eq!(server_side("server_error") + server_side("client_error"), 0.0);
    assert_eq!(metric(&m, "leanstream_queue_length"), 0.0);
}

#[test]
fn a_streamed_model_stays_within_its_memory_budget_under_load() {
    let Some(src) = common::model_path("smollm2") else {
        return;
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("serve");
    std::fs::create_dir_all(&dir).unwrap();
    let packed = dir.join("smollm2.lsflash");
    let out = Command::new(BIN)
        .args(["pack", "--model"])
        .arg(&src)
        .arg("-o")
        .arg(&packed)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let budget: u64 = 100 << 20;
    let server = Server::start(
        &packed,
        &[
            "--policy",
            "dense-stream",
            "--mem-budget",
            "100MiB",
            "--ctx",
            "512",
            "--queue",
            "16",
        ],
    );
    let v = load(&server, 40, 4, 8);
    assert_eq!(v["outcomes"]["lost"].as_f64().unwrap_or(0.0), 0.0, "{v}");
    let m = metrics(&server);
    let accounted: f64 = m
        .lines()
        .filter(|l| l.starts_with("leanstream_memory_bytes{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(
        accounted > 0.0 && accounted <= budget as f64,
        "accounted {accounted} over {budget}:\n{m}"
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid())).unwrap();
    let hwm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    // Beyond the accounted categories: the binary, thread stacks (engine,
    // I/O, HTTP), allocator slack and the HTTP stack's buffers.
    const SLACK: u64 = 24 << 20;
    assert!(
        hwm_kib * 1024 <= budget + SLACK,
        "peak RSS {} KiB over the budget plus slack",
        hwm_kib
    );
}

#[test]
fn chat_in_the_terminal_keeps_and_resets_the_conversation() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let reference = run_text(&model, PROMPT, 16, true);
    let mut child = Command::new(BIN)
        .args(["--threads", "2", "chat", "--model"])
        .arg(&model)
        .args(["--temp", "0", "-n", "16", "--no-prompt-cache"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input = format!("{PROMPT}\nAnd two more?\n/reset\n{PROMPT}\n");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let replies: Vec<&str> = text.split_terminator('\n').collect();
    // Replies may hold newlines of their own: compare by prefix and suffix.
    assert!(text.starts_with(&format!("{reference}\n")), "{text:?}");
    assert!(text.ends_with(&format!("\n{reference}\n")), "{text:?}");
    assert!(replies.len() >= 3, "{text:?}");
}

/// Drafting in the server: with the model drafting for itself (every draft
/// accepted, so runs of seven tokens a pass) the streamed text equals
/// `run`'s; `max_tokens` and a stop string that land inside an accepted
/// run end the text there; a load with cancellations loses nothing.
#[test]
fn drafting_streams_runs_text_and_stops_inside_an_accepted_run() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let draft = format!("model:{}", model.display());
    let server = Server::start(
        &model,
        &[
            "--ctx",
            "512",
            "--no-prompt-cache",
            "--draft",
            &draft,
            "--draft-len",
            "6",
        ],
    );
    let chat = |max_tokens: usize, stop: Option<&str>| {
        let mut body = json!({"messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": max_tokens, "temperature": 0, "stream": true});
        if let Some(s) = stop {
            body["stop"] = json!([s]);
        }
        let (status, _, out) = post(&server, "/v1/chat/completions", body.to_string().as_bytes());
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        sse_text(&out)
    };
    let full = run_text(&model, PROMPT, 40, true);
    assert_eq!(chat(40, None), full);
    assert_eq!(chat(9, None), run_text(&model, PROMPT, 9, true));
    // A stop string from the middle of the text: the answer ends before it.
    let words: Vec<&str> = full.split_whitespace().collect();
    let stop = words[words.len() / 2];
    let cut = &full[..full.find(stop).unwrap()];
    assert_eq!(chat(40, Some(stop)), cut, "stop {stop:?}");
    // Every draft of the model drafting for itself is accepted.
    let m = settled_metrics(&server);
    let accepted = metric(&m, "leanstream_draft_tokens_total{outcome=\"accepted\"}");
    assert!(accepted > 0.0, "{m}");
    assert_eq!(
        metric(&m, "leanstream_draft_tokens_total{outcome=\"refused\"}"),
        0.0,
        "{m}"
    );
    assert!(
        metric(&m, "leanstream_decode_passes_total") * 3.0 < metric(&m, "leanstream_completion_tokens_total"),
        "{m}"
    );
    let v = load(&server, 40, 4, 12);
    assert_eq!(v["answered"], 40);
    assert_eq!(v["outcomes"]["lost"].as_f64().unwrap_or(0.0), 0.0, "{v}");
    assert_eq!(v["outcomes"]["error"].as_f64().unwrap_or(0.0), 0.0, "{v}");
}

/// Packs `src` beside the other servers' test files (once per name).
fn packed(src: &Path, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("serve");
    std::fs::create_dir_all(&dir).unwrap();
    let out_path = dir.join(format!("{name}.batch.lsflash"));
    if !out_path.exists() {
        let out = Command::new(BIN)
            .args(["pack", "--model"])
            .arg(src)
            .arg("-o")
            .arg(&out_path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    out_path
}

/// Real prose to continue, of different lengths.
const CONTINUE: [&str; 4] = [
    "The river Danube flows through Germany, Austria, Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria, \
     Moldova and Ukraine before it reaches the Black Sea. For centuries",
    "Rain fell on the old town all night. By morning the streets were",
    "The library opened at nine, and the first visitor was",
    "In the morning the baker bakes bread, in the afternoon the baker sells bread, and in the evening the baker",
];

fn completion(s: &Server, prompt: &str, max_tokens: usize) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let (code, _, out) = post(s, "/v1/completions", body.to_string().as_bytes());
    let v = json_of(&out);
    assert_eq!(code, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Requests generating together (continuous batching, four at once,
/// arriving at once and so decoded in shared passes) each get the greedy
/// text they get served alone: both models, GGUF and streamed.
#[test]
fn requests_generating_together_get_the_text_each_gets_alone() {
    for name in ["smollm2", "gemma3"] {
        let Some(src) = common::model_path(name) else {
            return;
        };
        let flash = packed(&src, name);
        let runs: [(&Path, &[&str]); 2] = [
            (&src, &[]),
            (&flash, &["--policy", "dense-stream", "--ffn-budget", "25%"]),
        ];
        for (model, extra) in runs {
            let mut args = vec!["--parallel", "4", "--ctx", "256", "--no-prompt-cache"];
            args.extend_from_slice(extra);
            let server = Server::start(model, &args);
            let alone: Vec<String> = CONTINUE.iter().map(|p| completion(&server, p, 24)).collect();
            let together: Vec<String> = std::thread::scope(|sc| {
                let handles: Vec<_> = CONTINUE
                    .iter()
                    .map(|p| sc.spawn(|| completion(&server, p, 24)))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert_eq!(a, t, "{name} {extra:?}: request {i} served beside others");
            }
            let m = settled_metrics(&server);
            let (passes, rows) = (
                metric(&m, "leanstream_batch_passes_total"),
                metric(&m, "leanstream_batch_rows_total"),
            );
            // Alone, a pass holds one row; together the passes held more.
            assert!(rows > passes + 24.0, "{name} {extra:?}: {rows} rows in {passes} passes");
            assert_eq!(metric(&m, "leanstream_sequences_max"), 4.0);
        }
    }
}

/// `--parallel` with drafting, or with a CUDA device, is refused by name.
#[test]
fn parallel_requests_refuse_drafting_by_name() {
    let Some(model) = common::model_path("smollm2") else {
        return;
    };
    let out = Command::new(BIN)
        .args(["serve", "--model"])
        .arg(&model)
        .args(["--port", "0", "--parallel", "2", "--draft", "lookup"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("parallel") && err.contains("--draft"), "{err}");
}
