use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use leanstream_runtime::RuntimeError;
use serde_json::json;

/// Errors of the server library. Those a client caused are 4xx with the
/// offending parameter named; each becomes an OpenAI-style error object.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A malformed or unsupported request; `param` names the field.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
        /// OpenAI's machine-readable code, where it has one.
        code: Option<&'static str>,
    },
    #[error("missing or wrong API key (send it as 'Authorization: Bearer KEY')")]
    Unauthorized,
    #[error("no route for {0}")]
    NotFound(String),
    #[error("the request queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    EngineGone,
    #[error("binding {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl ServerError {
    pub fn bad(message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::QueueFull(_) | Self::EngineGone => StatusCode::SERVICE_UNAVAILABLE,
            Self::Bind { .. } | Self::Io(_) | Self::Runtime(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error object OpenAI's API answers with (`{"error": {...}}`).
    pub fn body(&self) -> serde_json::Value {
        let (kind, param, code) = match self {
            Self::BadRequest { param, code, .. } => ("invalid_request_error", param.clone(), *code),
            Self::Unauthorized => ("authentication_error", None, Some("invalid_api_key")),
            Self::NotFound(_) => ("invalid_request_error", None, Some("not_found")),
            Self::QueueFull(_) | Self::EngineGone => ("server_error", None, Some("overloaded")),
            Self::Bind { .. } | Self::Io(_) | Self::Runtime(_) => ("server_error", None, None),
        };
        json!({ "error": { "message": self.to_string(), "type": kind, "param": param, "code": code } })
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        match self {
            // One request's generation is the usual wait.
            Self::QueueFull(_) => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            Self::Unauthorized => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        r
    }
}
