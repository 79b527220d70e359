//! Chat prompt formatting. GGUF files carry a Jinja chat template; rather than
//! embed a template engine we recognise the template families in use (as
//! llama.cpp's built-in detection does) and format a single user turn.

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
        match self {
            Self::ChatMl { default_system } => {
                let system = default_system
                    .as_ref()
                    .map(|s| format!("<|im_start|>system\n{s}<|im_end|>\n"))
                    .unwrap_or_default();
                format!("{system}<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
            }
            Self::Gemma => format!("<start_of_turn>user\n{message}<end_of_turn>\n<start_of_turn>model\n"),
            Self::Llama3 => format!(
                "<|start_header_id|>user<|end_header_id|>\n\n{message}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            Self::Inst => format!("[INST] {message} [/INST]"),
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
}
