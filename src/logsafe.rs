//! Strings that peers control (certificate names, export names, upstream
//! messages) go into log lines only through here: a newline or an ANSI
//! escape in a certificate's CN must not forge a log line or repaint a
//! terminal, in the text format or the JSON one.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Refusals are summed up in one log line this often, so a flood cannot
/// turn into a flood of log lines.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Refusals said at most once per `REFUSAL_LOG_EVERY`, with their count.
#[derive(Default)]
pub struct RefusalLog {
    since_last: AtomicU64,
    last: Mutex<Option<Instant>>,
}

impl RefusalLog {
    /// Counts one refusal; returns the count to log when a line is due.
    pub fn due(&self) -> Option<u64> {
        self.since_last.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < REFUSAL_LOG_EVERY) {
            return None;
        }
        *last = Some(now);
        Some(self.since_last.swap(0, Ordering::Relaxed))
    }
}

/// `s` with every control character (C0, DEL, C1) and every Unicode
/// formatting character that reorders text (bidi overrides, isolates)
/// written as an escape: `\n`, `\r`, `\t`, `\\`, or `\u{1b}`.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Bytes that should be text but may not be: lossy UTF-8, then escaped.
pub fn escape_bytes(bytes: &[u8]) -> String {
    escape(&String::from_utf8_lossy(bytes)).into_owned()
}

fn needs_escape(c: char) -> bool {
    // A backslash is doubled, or a peer's literal `\n` would read as an
    // escaped newline.
    c == '\\' || c.is_control() || is_bidi_control(c)
}

fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Display adapter: `%Escaped(&name)` in a tracing field.
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn control_characters_and_bidi_overrides_are_escaped() {
        assert_eq!(escape("backup-agent"), "backup-agent");
        assert!(matches!(escape("plain"), Cow::Borrowed(_)));
        assert_eq!(
            escape("evil\nINFO forged\x1b[31m"),
            "evil\\nINFO forged\\u{1b}[31m"
        );
        assert_eq!(escape("a\r\tb\u{7f}\u{85}"), "a\\r\\tb\\u{7f}\\u{85}");
        assert_eq!(escape("x\u{202e}gnp.exe"), "x\\u{202e}gnp.exe");
        // A peer's literal backslash-n cannot pass for an escaped newline.
        assert_eq!(escape("a\\n\n"), "a\\\\n\\n");
        assert_eq!(escape_bytes(b"ok\xff\n"), "ok\u{fffd}\\n");
    }

    proptest! {
        #[test]
        fn escaped_text_has_no_control_characters(s in any::<String>()) {
            let escaped = escape(&s);
            prop_assert!(!escaped.chars().any(|c| c.is_control() || is_bidi_control(c)));
            if !s.chars().any(needs_escape) {
                prop_assert_eq!(escaped.as_ref(), s.as_str());
            }
        }
    }
}
