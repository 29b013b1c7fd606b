//! Who may call the API: the bearer token, and the browser checks (`Origin`, `Host`).
//!
//! - Token: with `http.token_file` set, every endpoint but the health checks needs `Authorization: Bearer <token>`;
//!   the scheme matches in any case, the token by a comparison whose time does not depend on where it differs.
//! - Origin: a browser adds `Origin` to every cross-site request (and a text/plain POST is a "simple" request it sends
//!   without asking first). A request whose `Origin` is not in `http.allowed_origins` is refused with 403, so a web
//!   page can neither post a capture nor read one through a user's browser.
//! - Host: DNS rebinding points a hostile name at 127.0.0.1, making a token-less loopback API same-origin to the
//!   attacker's page. On a loopback listen address the `Host` header must therefore name the listen address, a
//!   loopback name at its port, or an entry of `http.allowed_hosts`; beyond loopback (where a token is required)
//!   `http.allowed_hosts`, when set, is the list of accepted hosts.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::{ApiError, HttpState};
use crate::config::{HttpConfig, Secret};

#[derive(Debug)]
pub(super) struct Guard {
    token_opt: Option<Secret>,
    allowed_origins: Vec<String>,
    /// Exact `Host` values accepted.
    allowed_hosts: Vec<String>,
    /// Any `Host` is accepted (beyond loopback with no `http.allowed_hosts`).
    any_host: bool,
}

impl Guard {
    pub(super) fn new(config: &HttpConfig, token_opt: Option<Secret>, local_addr: SocketAddr) -> Guard {
        let port = local_addr.port();
        let mut allowed_hosts = config.allowed_hosts.clone();
        allowed_hosts.push(local_addr.to_string());
        if local_addr.ip().is_loopback() {
            for name in ["localhost", "127.0.0.1", "[::1]"] {
                allowed_hosts.push(format!("{name}:{port}"));
                if port == 80 {
                    allowed_hosts.push(name.to_string());
                }
            }
        }
        let any_host = !local_addr.ip().is_loopback() && config.allowed_hosts.is_empty();
        Guard { token_opt, allowed_origins: config.allowed_origins.clone(), allowed_hosts, any_host }
    }

    pub(super) fn requires_token(&self) -> bool {
        self.token_opt.is_some()
    }

    fn host_allowed(&self, host: &str) -> bool {
        self.any_host || self.allowed_hosts.iter().any(|allowed| allowed.eq_ignore_ascii_case(host))
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        self.allowed_origins.iter().any(|allowed| allowed.eq_ignore_ascii_case(origin))
    }

    /// Whether `authorization` (the header's value) carries the token.
    fn authorized(&self, authorization_opt: Option<&str>) -> bool {
        let Some(expected) = &self.token_opt else { return true };
        let given_opt = authorization_opt
            .and_then(|value| value.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        given_opt.is_some_and(|given| token_matches(expected.expose(), given))
    }
}

fn token_matches(expected: &str, given: &str) -> bool {
    // Compare every byte, so the time taken does not tell how much of a guess was right.
    expected.len() == given.len() && expected.bytes().zip(given.bytes()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
}

pub(super) async fn require_token(State(state): State<Arc<HttpState>>, request: Request, next: Next) -> Response {
    let authorization = request.headers().get(header::AUTHORIZATION).and_then(|value| value.to_str().ok());
    if !state.guard.authorized(authorization) {
        let mut response =
            ApiError::new(StatusCode::UNAUTHORIZED, "a bearer token is required (Authorization: Bearer <token>)")
                .into_response();
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    next.run(request).await
}

/// Refuses requests from web pages that are not allowed, and requests for a host this server does not serve.
pub(super) async fn check_origin_and_host(
    State(state): State<Arc<HttpState>>,
    request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin_text = origin.to_str().unwrap_or("");
        if !state.guard.origin_allowed(origin_text) {
            return ApiError::forbidden(
                "Origin",
                format!("requests from web pages are refused: origin {origin_text:?} is not in http.allowed_origins"),
            )
            .into_response();
        }
    }
    if let Some(host) = headers.get(header::HOST) {
        let host_text = host.to_str().unwrap_or("");
        if !state.guard.host_allowed(host_text) {
            return ApiError::forbidden(
                "Host",
                format!("host {host_text:?} is not served here (the listen address, a loopback name, or http.allowed_hosts)"),
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// CORS headers for the allowed origins (none when the list is empty: no page may call the API).
pub(super) fn cors_layer(config: &HttpConfig) -> Option<CorsLayer> {
    if config.allowed_origins.is_empty() {
        return None;
    }
    let origins: Vec<HeaderValue> =
        config.allowed_origins.iter().filter_map(|origin| HeaderValue::from_str(origin).ok()).collect();
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .expose_headers([
                header::HeaderName::from_static("x-capstore-stream"),
                header::HeaderName::from_static("x-capstore-version"),
                header::HeaderName::from_static("x-capstore-captured-at-ns"),
            ]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(listen: &str, allowed_hosts: &[&str], token: Option<&str>) -> Guard {
        let config = HttpConfig {
            allowed_hosts: allowed_hosts.iter().map(|host| host.to_string()).collect(),
            allowed_origins: vec!["https://tool.example".into()],
            ..HttpConfig::default()
        };
        Guard::new(&config, token.map(Secret::new), listen.parse().unwrap())
    }

    #[test]
    fn token_comparison() {
        assert!(token_matches("secret", "secret"));
        assert!(!token_matches("secret", "secreT"));
        assert!(!token_matches("secret", "secret2"));
    }

    #[test]
    fn the_bearer_scheme_matches_in_any_case_and_the_token_exactly() {
        let open_guard = guard("127.0.0.1:9464", &[], None);
        let guard = guard("127.0.0.1:9464", &[], Some("0123456789abcdef"));
        for good in ["Bearer 0123456789abcdef", "bearer 0123456789abcdef", "BEARER  0123456789abcdef "] {
            assert!(guard.authorized(Some(good)), "{good}");
        }
        for bad in ["Bearer 0123456789abcdeF", "Basic 0123456789abcdef", "0123456789abcdef", ""] {
            assert!(!guard.authorized(Some(bad)), "{bad}");
        }
        assert!(!guard.authorized(None));
        assert!(open_guard.authorized(None), "no token configured: open");
    }

    #[test]
    fn on_loopback_only_the_listen_address_and_loopback_names_are_served() {
        let guard = guard("127.0.0.1:9464", &["capstore.internal:9464"], None);
        for good in ["127.0.0.1:9464", "localhost:9464", "LOCALHOST:9464", "[::1]:9464", "capstore.internal:9464"] {
            assert!(guard.host_allowed(good), "{good}");
        }
        for bad in ["evil.example:9464", "localhost:80", "127.0.0.1:9465", "rebind.attacker.example"] {
            assert!(!guard.host_allowed(bad), "{bad}");
        }
        assert!(guard.origin_allowed("https://tool.example") && !guard.origin_allowed("https://evil.example"));
    }

    #[test]
    fn beyond_loopback_any_host_unless_a_list_is_given() {
        assert!(guard("0.0.0.0:9464", &[], Some("0123456789abcdef")).host_allowed("10.1.2.3:9464"));
        let listed = guard("0.0.0.0:9464", &["capture.example:9464"], Some("0123456789abcdef"));
        assert!(listed.host_allowed("capture.example:9464") && !listed.host_allowed("10.1.2.3:9464"));
    }
}
