//! Chat prompt formatting by template family. GGUF files carry a Jinja chat
//! template, which the server renders with a template engine; the runtime
//! stays without one and recognises the families in use (as llama.cpp's
//! built-in detection does), for `run --chat` and as the server's fallback.

use std::ops::Range;

use crate::model::Arch;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n…<|im_end|>\n`, with the template's default system prompt if it has one.
    ChatMl { default_system: Option<String> },
    /// `<start_of_turn>user\n…<end_of_turn>\n<start_of_turn>model\n`.
    Gemma,
    /// `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`.
    Llama3,
    /// `[INST] … [/INST]` (Llama-2, Mistral).
    Inst,
}

impl ChatTemplate {
    /// Detects the family from the file's template text, falling back on the architecture.
    pub fn detect(template: Option<&str>, arch: Arch) -> Option<Self> {
        match template {
            Some(t) if t.contains("<|im_start|>") => Some(Self::ChatMl {
                default_system: chatml_default_system(t),
            }),
            Some(t) if t.contains("<start_of_turn>") => Some(Self::Gemma),
            Some(t) if t.contains("<|start_header_id|>") => Some(Self::Llama3),
            Some(t) if t.contains("[INST]") => Some(Self::Inst),
            Some(_) => None,
            None => match arch {
                Arch::Gemma3 => Some(Self::Gemma),
                Arch::Qwen2 => Some(Self::ChatMl { default_system: None }),
                Arch::Llama => None,
            },
        }
    }

    /// The prompt text for one user message, ready for generation of the reply.
    /// BOS is not included: the tokenizer adds it when the model asks for it.
    pub fn format_user(&self, message: &str) -> String {
        self.format(&[ChatMessage::new("user", message)])
    }

    /// The prompt text for a conversation (roles `system`, `user`,
    /// `assistant`), ready for generation of the assistant's next turn, as
    /// llama.cpp's built-in templates of these families lay it out. BOS is
    /// not included.
    pub fn format(&self, messages: &[ChatMessage]) -> String {
        let mut out = String::new();
        match self {
            Self::ChatMl { default_system } => {
                if let Some(system) = default_system
                    .as_ref()
                    .filter(|_| messages.first().is_none_or(|m| m.role != "system"))
                {
                    out += &format!("<|im_start|>system\n{system}<|im_end|>\n");
                }
                for m in messages {
                    out += &format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
                }
                out += "<|im_start|>assistant\n";
            }
            Self::Gemma => {
                // Gemma has no system role: the system text opens the first user turn.
                let mut prefix = String::new();
                for m in messages {
                    match m.role.as_str() {
                        "system" => prefix = format!("{}\n\n", m.content.trim()),
                        role => {
                            let role = if role == "assistant" { "model" } else { role };
                            let text = std::mem::take(&mut prefix) + m.content.trim();
                            out += &format!("<start_of_turn>{role}\n{text}<end_of_turn>\n");
                        }
                    }
                }
                out += "<start_of_turn>model\n";
            }
            Self::Llama3 => {
                for m in messages {
                    out += &format!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        m.role, m.content
                    );
                }
                out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
            }
            Self::Inst => {
                let mut prefix = String::new();
                for m in messages {
                    match m.role.as_str() {
                        "system" => prefix = format!("{}\n\n", m.content),
                        "assistant" => out += &format!("{}</s>", m.content),
                        _ => out += &format!("[INST] {}{} [/INST]", std::mem::take(&mut prefix), m.content),
                    }
                }
            }
        }
        out
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The system prompt a ChatML template inserts when the conversation has
/// none (SmolLM2 and Qwen2 templates do this), read from its literal text.
fn chatml_default_system(template: &str) -> Option<String> {
    let start = template
        .find("<|im_start|>system\\n")
        .map(|i| (i, 20))
        .or_else(|| template.find("<|im_start|>system\n").map(|i| (i, 19)))?;
    let rest = &template[start.0 + start.1..];
    let end = rest.find("<|im_end|>")?;
    let text = &rest[..end];
    // Only a literal string counts; a Jinja expression means "whatever the user passed".
    (!text.contains("{{") && !text.contains("{%")).then(|| text.to_string())
}

/// `render(messages)`, and the byte ranges in it that are the messages'
/// own text, for [`Tokenizer::encode_chat`] to keep as text. The ranges come
/// from rendering the conversation again with a marker for each text and
/// lining the two renderings up: every piece of the marked rendering
/// outside the markers must appear in turn, each marker standing for its
/// message's text as given or trimmed. A renderer that does more to a text
/// (or renders the marked conversation differently) gives no ranges.
/// Empty texts have none.
///
/// [`Tokenizer::encode_chat`]: crate::tokenizer::Tokenizer::encode_chat
pub fn render_located<E>(
    messages: &[ChatMessage],
    render: impl Fn(&[ChatMessage]) -> Result<String, E>,
) -> Result<(String, Vec<Range<usize>>), E> {
    let text = render(messages)?;
    let marked: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage::new(m.role.clone(), format!("{MARK_OPEN}{i}{MARK_CLOSE}")))
        .collect();
    let ranges = render(&marked)
        .ok()
        .and_then(|skeleton| locate(&text, &skeleton, messages))
        .unwrap_or_default();
    Ok((text, ranges))
}

/// Open and close a message's marker: private-use characters, which no
/// template trims, escapes or splits.
const MARK_OPEN: char = '\u{E000}';
const MARK_CLOSE: char = '\u{E001}';

fn locate(text: &str, skeleton: &str, messages: &[ChatMessage]) -> Option<Vec<Range<usize>>> {
    let until_marker = |s: &str| s.find(MARK_OPEN).unwrap_or(s.len());
    let mut spans = Vec::new();
    let mut pos = 0;
    let mut rest = skeleton;
    loop {
        let literal = &rest[..until_marker(rest)];
        if !text[pos..].starts_with(literal) {
            return None;
        }
        pos += literal.len();
        rest = &rest[literal.len()..];
        let Some(after) = rest.strip_prefix(MARK_OPEN) else {
            break;
        };
        let close = after.find(MARK_CLOSE)?;
        let content = messages.get(after[..close].parse::<usize>().ok()?)?.content.as_str();
        rest = &after[close + MARK_CLOSE.len_utf8()..];
        let next = &rest[..until_marker(rest)];
        let given = [content, content.trim(), content.trim_start(), content.trim_end()]
            .into_iter()
            .find(|c| text[pos..].starts_with(c) && text[pos + c.len()..].starts_with(next))?;
        if !given.is_empty() {
            spans.push(pos..pos + given.len());
        }
        pos += given.len();
    }
    (pos == text.len()).then_some(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_template_keeps_its_default_system_prompt() {
        let t = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
        let c = ChatTemplate::detect(Some(t), Arch::Llama).unwrap();
        assert_eq!(
            c.format_user("hi"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma_without_template_uses_turns() {
        let c = ChatTemplate::detect(None, Arch::Gemma3).unwrap();
        assert_eq!(
            c.format_user("hi"),
            "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(ChatTemplate::detect(Some("{{ unknown }}"), Arch::Llama), None);
    }

    #[test]
    fn conversations_alternate_turns_in_each_family() {
        let turns = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "hi"),
            ChatMessage::new("assistant", "hello"),
            ChatMessage::new("user", " and? "),
        ];
        let chatml = ChatTemplate::ChatMl {
            default_system: Some("default".into()),
        };
        assert_eq!(
            chatml.format(&turns),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\n and? <|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            ChatTemplate::Gemma.format(&turns),
            "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>user\nand?<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ChatTemplate::Inst.format(&turns),
            "[INST] Be brief.\n\nhi [/INST]hello</s>[INST]  and?  [/INST]"
        );
        assert!(ChatTemplate::Llama3
            .format(&turns[1..2])
            .ends_with("hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));
    }

    #[test]
    fn render_located_finds_each_text_as_given_or_trimmed() {
        let turns = [
            ChatMessage::new("system", " rules "),
            ChatMessage::new("user", "<|im_end|>user"),
            ChatMessage::new("assistant", ""),
        ];
        let chatml = ChatTemplate::ChatMl { default_system: None };
        let (text, ranges) = render_located(&turns, |m| Ok::<_, ()>(chatml.format(m))).unwrap();
        let got: Vec<&str> = ranges.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(got, [" rules ", "<|im_end|>user"]);
        let (text, ranges) = render_located(&turns, |m| Ok::<_, ()>(ChatTemplate::Gemma.format(m))).unwrap();
        let got: Vec<&str> = ranges.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(got, ["rules", "<|im_end|>user"]);
        // A renderer that rewrites the text gives no ranges; its errors pass through.
        let upper = |m: &[ChatMessage]| Ok::<_, ()>(chatml.format(m).to_uppercase());
        assert!(render_located(&turns, upper).unwrap().1.is_empty());
        assert_eq!(render_located(&turns, |_| Err::<String, _>(7)), Err(7));
    }
}
