/*
 * capstore: same-spool takeover (DESIGN.md section 7; LeaseStore::claim with
 * publish_not_before, LeaseHandle::permit).  Publisher 0 runs the full
 * protocol (claims, renewals, publishes, unknown outcomes) until it is
 * SIGKILLed at any instant; publisher 1 has the same spool id, gets the flock,
 * and may claim over publisher 0's live head at once.
 *
 * Variants (expected verdicts in check.sh):
 *   (none)      claim and publish at once (DESIGN 7 as first written)
 *   EMB_SENT    no permit until publish_timeout + clock_skew + 0.1 s after the
 *               takeover claim was SENT (the first version of the fix)
 *   EMB_REPLY   the same embargo counted from when the claim's read-back said
 *               held (what src/catalog/lease/store.rs does)
 *   EMB_REPLY OWN_HEAD_AT_ONCE
 *               control: a start whose claim went unanswered keeps its lease id
 *               (as everywhere in takeover.pml) and claims again at once over
 *               its own live head without the embargo
 * The protocol itself is specs/lease_safety.pml.
 */
#define TAKEOVER 1
#define START_KEEPS_ID 1
#define TTL 5           /* TTL 4 leaves the fence open for one instant only (see README) */
#include "lease_safety.pml"
