//! `leanstream serve`: an OpenAI-compatible HTTP API over one LeanStream
//! engine, and `leanstream chat`, a terminal client of the same engine.
//!
//! One model, one engine thread (`worker`): requests wait in a bounded queue
//! and run one at a time, so the memory budget the engine was opened with
//! holds whatever the request pattern; a full queue answers 503 with
//! `Retry-After`. The async stack (axum on tokio) lives here only, so the
//! runtime library stays without one.

pub mod api;
mod batching;
pub mod error;
pub mod metrics;
pub mod prompt_cache;
mod reply;
pub mod request;
pub mod routes;
pub mod stop;
pub mod template;
pub mod terminal;
pub mod worker;

use std::sync::Arc;

pub use error::ServerError;
pub use worker::{Engine, EngineOptions};

/// Where to listen and who may ask.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    /// 0 picks a free port (the address is printed on stderr).
    pub port: u16,
    /// Required as `Authorization: Bearer KEY` on `/v1/*` when set.
    pub api_key: Option<String>,
}

/// Serves `engine` until Ctrl-C or SIGTERM. Prints `listening on
/// http://ADDR` on stderr once the socket is bound.
pub fn serve(engine: Engine, opts: ServeOptions) -> Result<(), ServerError> {
    let state = Arc::new(routes::AppState::new(engine, opts.api_key));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("leanstream-http")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| ServerError::Bind { addr, source })?;
        let local = listener.local_addr()?;
        let info = state.engine.info();
        eprintln!(
            "leanstream: serving {} (context {} tokens, queue of {}), listening on http://{local}",
            info.name,
            info.ctx,
            state.engine.queue_capacity()
        );
        axum::serve(listener, routes::router(state))
            .with_graceful_shutdown(shutdown())
            .await?;
        Ok(())
    })
}

async fn shutdown() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
