//! The time and memory limits every catalog read carries, as the catalog user's settings profile lets a request set
//! them.
//!
//! Every read asks the server to stop it after `catalog.request_timeout` (`max_execution_time`) and at
//! `catalog.read_max_memory` (`max_memory_usage`), so that no read can run on or starve the server. A settings
//! profile may constrain either setting (ClickHouse 20.x and later): a bound above or below which a request may not
//! set it, or none at all. The server then refuses the whole read before it runs anything (code 452, naming the
//! setting and the bound), and so would refuse every read of the daemon.
//!
//! States, per setting, shared by the clones of a client: *ours* (the configured value is sent) until a constraint
//! refuses it, then, for good, bounded by what the refusals stated (a constraint with a least and a most takes two
//! refusals, one by a read whose value is below the least, one by a read above the most):
//! - *at most* N: the value sent is the configured one, or N where that is lower (the server would stop reads there
//!   anyway);
//! - *at least* N: the configured one, or N where that is higher (the client still gives up after
//!   `catalog.request_timeout`, and servers from 20.x on cancel a read whose client has gone);
//! - *fixed*: not sent; the profile's own value bounds the read.
//!
//! Each change is logged once, as a warning where the read may now run longer or use more memory than configured.
//! A refusal this module cannot read stays an error, with a hint naming the settings and the configuration keys.

use std::sync::{Arc, Mutex};

/// The settings of a read's limits that a profile's constraint may refuse (the ones this module adapts to).
pub const LIMIT_SETTINGS: [&str; 2] = ["max_execution_time", "max_memory_usage"];

/// What a settings profile's constraint lets a request set a setting to, read from the server's refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileBound {
    AtMost(u64),
    AtLeast(u64),
    Fixed,
}

impl ProfileBound {
    /// The constraint a refusal of `setting` states: "Setting max_memory_usage shouldn't be greater than 500000000",
    /// "... shouldn't be less than 60", "... should not be changed" (ClickHouse 20.x to 26.x). A bound with a
    /// fraction (of seconds) is taken inward: a most rounded down, a least up. None for any other text, and for a
    /// most below 1 (0 would mean no limit at all).
    pub fn from_refusal(setting: &str, message: &str) -> Option<ProfileBound> {
        let rest = message.split(&format!("Setting {setting} ")).nth(1)?;
        // The whole part of the number after `prefix`, and whether a fraction follows it.
        let number_after = |prefix: &str| -> Option<(u64, bool)> {
            let text = rest.strip_prefix(prefix)?;
            let whole: String = text.chars().take_while(|c| c.is_ascii_digit()).collect();
            let fraction: String = text[whole.len()..]
                .strip_prefix('.')
                .map(|after| after.chars().take_while(|c| c.is_ascii_digit()).collect())
                .unwrap_or_default();
            Some((whole.parse().ok()?, fraction.chars().any(|digit| digit != '0')))
        };
        if let Some((most, _)) = number_after("shouldn't be greater than ") {
            return (most > 0).then_some(ProfileBound::AtMost(most));
        }
        if let Some((least, fraction)) = number_after("shouldn't be less than ") {
            return Some(ProfileBound::AtLeast(least + u64::from(fraction)));
        }
        (rest.starts_with("should not be changed") || rest.starts_with("shouldn't be changed"))
            .then_some(ProfileBound::Fixed)
    }

    /// The value a read sends instead of `ours`; None: the setting is not sent.
    fn applied_to(self, ours: u64) -> Option<u64> {
        match self {
            ProfileBound::AtMost(bound) => Some(ours.min(bound)),
            ProfileBound::AtLeast(bound) => Some(ours.max(bound)),
            ProfileBound::Fixed => None,
        }
    }

    /// Whether a read may now run longer or use more than configured.
    fn loosens(self) -> bool {
        !matches!(self, ProfileBound::AtMost(_))
    }
}

/// The bounds learnt so far (see the module's doc), shared by the clones of a client.
#[derive(Debug, Clone, Default)]
pub struct ReadLimits {
    bounds: Arc<Mutex<Vec<(&'static str, ProfileBound)>>>,
}

impl ReadLimits {
    /// The limit settings of a read, `ours` as configured, adapted to what the profile lets a request set.
    pub fn settings(&self, ours: [(&'static str, u64); 2]) -> Vec<(&'static str, String)> {
        let bounds = self.bounds.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        ours.into_iter()
            .filter_map(|(name, value)| {
                // A least and a most of one setting both apply (a constraint may have both).
                let mut sent = Some(value);
                for (_, bound) in bounds.iter().filter(|(known, _)| *known == name) {
                    sent = sent.and_then(|value| bound.applied_to(value));
                }
                sent.map(|value| (name, value.to_string()))
            })
            .collect()
    }

    /// Learn the bound a refusal (`message`, a constraint's) states for one of [`LIMIT_SETTINGS`]; true when it
    /// states one, so the read is worth sending again (a read sent beside the one that taught it is refused for the
    /// same bound: known already, it is not logged again). The configured values `ours` are for the log line only.
    pub fn learn(&self, message: &str, ours: [(&'static str, u64); 2]) -> bool {
        let Some((setting, bound)) = LIMIT_SETTINGS
            .iter()
            .find_map(|setting| ProfileBound::from_refusal(setting, message).map(|bound| (*setting, bound)))
        else {
            return false;
        };
        let mut bounds = self.bounds.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if bounds.iter().any(|(known, found)| *known == setting && *found == bound) {
            return true;
        }
        // A new bound of a kind known for the setting replaces it, and a fixed setting any other (the profile
        // changed); a least and a most stay side by side, as the constraint has them.
        let stays = |found: &ProfileBound| {
            let fixed = [*found, bound].contains(&ProfileBound::Fixed);
            !fixed && std::mem::discriminant(found) != std::mem::discriminant(&bound)
        };
        bounds.retain(|(known, found)| *known != setting || stays(found));
        bounds.push((setting, bound));
        let configured = ours.iter().find(|(name, _)| *name == setting).map_or(0, |(_, value)| *value);
        let sent = bound.applied_to(configured);
        let describe = describe(setting, bound, configured, "the refused read's");
        if bound.loosens() && sent != Some(configured) {
            tracing::warn!(setting, configured, ?sent, "catalog: {describe}");
        } else {
            tracing::info!(setting, configured, ?sent, "catalog: {describe}");
        }
        true
    }

    /// The settings the profile allows no value of: reads are bounded by the profile's own.
    pub fn fixed(&self) -> Vec<&'static str> {
        let bounds = self.bounds.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        bounds.iter().filter(|(_, bound)| *bound == ProfileBound::Fixed).map(|(setting, _)| *setting).collect()
    }

    /// One line per bound learnt, for `check-config --online`; empty while every read sends the configured limits.
    pub fn described(&self, ours: [(&'static str, u64); 2]) -> Vec<String> {
        let bounds = self.bounds.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        bounds
            .iter()
            .map(|(setting, bound)| {
                let configured = ours.iter().find(|(name, _)| name == setting).map_or(0, |(_, value)| *value);
                let key = match *setting {
                    "max_execution_time" => "catalog.request_timeout",
                    _ => "catalog.read_max_memory",
                };
                describe(setting, *bound, configured, key)
            })
            .collect()
    }
}

/// What reads do about a profile's bound of `setting`, in words; `configured` is the value `key` names.
fn describe(setting: &str, bound: ProfileBound, configured: u64, key: &str) -> String {
    match bound {
        ProfileBound::AtMost(most) if most < configured => format!(
            "the settings profile lets a read set {setting} to at most {most}: reads are bounded there, below {key} \
             ({configured})"
        ),
        ProfileBound::AtMost(most) => format!("the settings profile lets a read set {setting} to at most {most}"),
        ProfileBound::AtLeast(least) if least > configured => format!(
            "the settings profile lets a read set {setting} to no less than {least}: reads are bounded there, above \
             {key} ({configured})"
        ),
        ProfileBound::AtLeast(least) => {
            format!("the settings profile lets a read set {setting} to no less than {least}")
        }
        ProfileBound::Fixed => format!(
            "the settings profile does not let a read set {setting}: reads are bounded by the profile's value instead \
             of {key} ({configured}), if it sets one (check-config --online fails a 0)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: [(&str, u64); 2] = [("max_execution_time", 10), ("max_memory_usage", 1 << 30)];

    #[test]
    fn a_constraint_s_refusal_is_read_as_its_bound() {
        let refusal = |text: &str| format!("Code: 452. DB::Exception: {text}. (SETTING_CONSTRAINT_VIOLATION)");
        let at_most = refusal("Setting max_memory_usage shouldn't be greater than 500000000");
        assert_eq!(ProfileBound::from_refusal("max_memory_usage", &at_most), Some(ProfileBound::AtMost(500_000_000)));
        let at_least = refusal("Setting max_execution_time shouldn't be less than 60");
        assert_eq!(ProfileBound::from_refusal("max_execution_time", &at_least), Some(ProfileBound::AtLeast(60)));
        let fixed = refusal("Setting max_memory_usage should not be changed");
        assert_eq!(ProfileBound::from_refusal("max_memory_usage", &fixed), Some(ProfileBound::Fixed));
        // Fractions of seconds are taken inward, and no most rounds to 0 (no limit at all).
        let fraction = refusal("Setting max_execution_time shouldn't be greater than 2.5");
        assert_eq!(ProfileBound::from_refusal("max_execution_time", &fraction), Some(ProfileBound::AtMost(2)));
        let fraction = refusal("Setting max_execution_time shouldn't be less than 2.5");
        assert_eq!(ProfileBound::from_refusal("max_execution_time", &fraction), Some(ProfileBound::AtLeast(3)));
        let below_one = refusal("Setting max_execution_time shouldn't be greater than 0.5");
        assert_eq!(ProfileBound::from_refusal("max_execution_time", &below_one), None);
        // Another setting's refusal, or words of another kind, are not read.
        assert_eq!(ProfileBound::from_refusal("max_execution_time", &at_most), None);
        let other = refusal("Setting max_memory_usage shouldn't be greater than a lot");
        assert_eq!(ProfileBound::from_refusal("max_memory_usage", &other), None);
    }

    #[test]
    fn reads_send_their_limits_within_the_bounds_learnt() {
        let limits = ReadLimits::default();
        let sent = |limits: &ReadLimits| limits.settings(OURS);
        assert_eq!(sent(&limits), [("max_execution_time", "10".into()), ("max_memory_usage", "1073741824".into())]);
        let refusal = "Setting max_memory_usage shouldn't be greater than 500000000. (SETTING_CONSTRAINT_VIOLATION)";
        assert!(limits.learn(refusal, OURS));
        assert!(limits.learn(refusal, OURS), "a read sent beside the first is sent again too");
        assert!(limits.learn("Setting max_execution_time shouldn't be less than 60", OURS));
        assert_eq!(sent(&limits), [("max_execution_time", "60".into()), ("max_memory_usage", "500000000".into())]);
        // A most beside the least (a constraint of both, met by a longer read): the configured value between them.
        assert!(limits.learn(
            "Setting max_execution_time shouldn't be greater than 600",
            [("max_execution_time", 1800), OURS[1]]
        ));
        assert_eq!(sent(&limits)[0], ("max_execution_time", "60".into()));
        assert_eq!(limits.settings([("max_execution_time", 1800), OURS[1]])[0], ("max_execution_time", "600".into()));
        assert!(limits.clone().learn("Setting max_memory_usage should not be changed", OURS));
        assert_eq!(sent(&limits), [("max_execution_time", "60".into())], "clones share what they learn");
        assert_eq!(limits.described(OURS).len(), 3);
        assert!(!limits.learn("Setting max_threads should not be changed", OURS), "not a limit of this module");
    }
}
