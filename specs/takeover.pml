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
 *   EMB_REPLY START_KEEPS_ID OWN_HEAD_AT_ONCE
 *               control (the code before): a start whose claim went unanswered
 *               claims again with the same lease id, and a claim over its own
 *               live head takes no embargo.  Otherwise a start claims again with
 *               a fresh lease id, and a live head of an earlier lease id of its
 *               own is a takeover (the holder names the spool)
 *   EMB_REPLY SOLE_HEAD_ONLY
 *               a contested head is refused even where its every lease id is
 *               the spool's (the code before that takeover; by default it is
 *               taken over, with the embargo)
 *   EMB_REPLY CONTESTED_AT_ONCE
 *               control: such a contested head taken over with no embargo
 * The protocol itself is specs/lease_safety.pml.
 */
#define TAKEOVER 1
#ifndef START_KEEPS_ID
#define START_FRESH_ID 1
#endif
#define TTL 5           /* TTL 4 leaves the fence open for one instant only (see README) */
#include "lease_safety.pml"
