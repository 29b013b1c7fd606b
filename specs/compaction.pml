/*
 * capstore: a capture's pack moving under readers (compaction's switch-over, erasure and the removal of the old
 * object, and the removal of a deleted capture's rows; src/pipeline/compaction.rs, Publisher::publish_relocation,
 * CatalogReader::list, src/catalog/retired.rs, src/catalog/purge.rs).
 *
 * One capture X, first published in pack A (object 0). A compactor copies it into pack B (object 1) and switches
 * it there with one versioned publish of a *move* row; a deleter may delete X (a tombstone row) at any instant; a
 * reader pins a watermark and lists X any number of times, at any instant, until it lets go. Small enough for an
 * exhaustive search. Each option of the world's loop is one atomic step.
 *
 * Tables, as rows of X: (version, kind, committed, in `captures`, still in `captures`). `by_version`/`by_id` hold
 * every row ever written; `captures` (ReplacingMergeTree by version) holds the rows written to it, and a merge
 * may at any instant keep only its highest-version row of X, committed or not. A publish writes its rows, then
 * commits its version (the fenced `publishes` row) or is refused and leaves them orphans. The publish turn makes
 * the switch's re-check, rows and commit one step against a deletion of this process.
 *
 * A list at watermark W (CatalogReader::list then newest_of): the candidate is X's highest committed row at or
 * below W in `captures`; if by_id has a newer committed row at or below W, a move replaces the candidate and
 * anything else (a tombstone) drops it.
 *
 * Grace (lifecycle.read_grace): the old object is removed only once no reader pinned below its retirement is still
 * reading; the grace period is what bounds such a reader in the real system. Erasure: once X is deleted, each pack
 * a committed row of X names is rewritten without it (here: retired, X being its only capture), found through
 * those rows. The rows of a deleted X below its tombstone are removed from every table (the tombstone stays) once
 * every object they name is retired and no reader pinned below the tombstone is still reading.
 *
 * Variants (spin -DNAME -a compaction.pml); expected verdicts are in check.sh.
 *   (none)            the design
 *   MOVE_IN_CAPTURES  control: move rows also written to `captures` (a merge then loses X for pinned readers)
 *   LIST_DROPS_MOVES  control: a list drops a candidate with any newer row (schema 4's rule)
 *   NO_RECHECK        control: the switch does not re-check X's newest row inside the turn
 *   NO_GRACE          control: the old object is removed as soon as its retirement commits
 *   NO_PURGE_GRACE    control: a deleted capture's rows are removed as soon as its deletion commits
 *   PURGE_BEFORE_ERASURE control: the rows are removed whether or not the packs they name are rewritten yet
 *
 * Properties (assertion markers):
 *   READ_EXACTLY_ONCE     a list at W returns X once, at the place of its newest committed row at or below W,
 *                         when that row is not a tombstone, and not at all when it is
 *   NO_DANGLING_LOCATOR   a place a list returns is an object that exists
 *   NO_RESURRECTION       once a deletion commits, X's newest committed row stays a tombstone
 *   PINNED_SNAPSHOT       a reader pinned at W lists the same answer every time it lists, until it lets go
 *   ERASURE_FINDABLE      a row removed names an object that is retired already (else erasure, which finds a
 *                         deleted capture's packs by its rows, could no longer find that one)
 */

#define CAP_A 1     /* the capture, in pack A */
#define MOVE_B 2    /* a move of the capture to pack B */
#define TOMB 3      /* a deletion */
#define MAXROWS 5

typedef Row { byte v; byte kind; bool com; bool incap; };
Row rows[MAXROWS];
byte nrows = 1;
byte wm = 1;                  /* the watermark: versions 1..wm are committed */
bool exists[2];               /* objects of A (0) and B (1) */
byte retired_at = 0;          /* the version that retired A */
byte b_retired_at = 0;        /* the version that retired B (erasure after a switch) */
byte cstate = 0;              /* compactor: 0 idle, 1 B written and uploaded, 2 done */
byte failures = 0;            /* refused switches so far (at most 1) */
bool deleted_ever = false;
byte rstate = 0;              /* reader: 0 not started, 1 pinned, 2 done */
byte rw = 0;                  /* the reader's pinned watermark */
byte pin_loc = 0;             /* what the pinned reader listed first: 255 nothing, else the object */
bool listed = false;          /* the pinned reader has listed once */
byte deleted_at = 0;          /* the version of the tombstone */
bool purged = false;          /* X's rows below the tombstone are removed */

/* Assertion markers: always 0, named in pan's message when their assertion fails. */
bit READ_EXACTLY_ONCE;
bit NO_DANGLING_LOCATOR;
bit NO_RESURRECTION;
bit PINNED_SNAPSHOT;
bit ERASURE_FINDABLE;

/* Scratch, reset at the end of each step (not part of the state between steps). */
byte i, best, cand, newest, loc, truth;
bool named_retired;

/* best := index of the highest committed row at or below w (over all rows when all, else those in captures) */
inline highest(w, all) {
  best = 255; i = 0;
  do
  :: i < nrows ->
     if
     :: rows[i].com && rows[i].v <= w && (all || rows[i].incap) &&
        (best == 255 || rows[i].v > rows[best].v || (rows[i].v == rows[best].v && i > best)) -> best = i
     :: else -> skip
     fi; i++
  :: else -> break
  od
}

/* a row's object: 0 for A, 1 for B */
#define place(k) ((k) == MOVE_B -> 1 : 0)

inline add_row(version, k, committed, in_captures) {
  rows[nrows].v = version; rows[nrows].kind = k; rows[nrows].com = committed; rows[nrows].incap = in_captures;
  nrows++
}

#ifdef MOVE_IN_CAPTURES
#define MOVES_IN_CAPTURES true
#else
#define MOVES_IN_CAPTURES false
#endif

inline list_and_check() {
  highest(rw, false); cand = best;
  highest(rw, true); newest = best;
  /* truth: the newest committed row at or below rw */
  truth = (newest == 255 -> 0 : rows[newest].kind);
  if
  :: cand == 255 -> loc = 255
  :: else ->
     if
#ifdef LIST_DROPS_MOVES
     :: rows[newest].v > rows[cand].v -> loc = 255
#else
     :: rows[newest].v > rows[cand].v && rows[newest].kind == MOVE_B -> loc = 1
     :: rows[newest].v > rows[cand].v && rows[newest].kind != MOVE_B -> loc = 255
#endif
     :: else -> loc = place(rows[cand].kind)
     fi
  fi;
  assert(((truth == TOMB || truth == 0) && loc == 255) ||
         (truth != TOMB && truth != 0 && loc == place(truth)) || READ_EXACTLY_ONCE);
  assert(loc == 255 || exists[loc] || NO_DANGLING_LOCATOR);
  if
  :: rstate == 1 && !listed -> pin_loc = loc; listed = true
  :: rstate == 1 && listed -> assert(loc == pin_loc || PINNED_SNAPSHOT)
  :: else -> skip
  fi
}

init {
  rows[0].v = 1; rows[0].kind = CAP_A; rows[0].com = true; rows[0].incap = true;
  exists[0] = true;
  do
  /* The reader: pins the current watermark, lists any number of times, lets go. */
  :: atomic { rstate == 0 -> rw = wm; rstate = 1 }
  :: atomic { rstate == 1 -> list_and_check(); i = 0; best = 0; cand = 0; newest = 0; loc = 0; truth = 0 }
  :: atomic { rstate == 1 -> rstate = 2 }
  /* A reader that pins later reads at the newest watermark (the current reads of every other client). */
  :: atomic { rstate == 2 -> rw = wm; list_and_check(); i = 0; best = 0; cand = 0; newest = 0; loc = 0; truth = 0 }

  /* The compactor plans on X's newest committed row and copies it into B (uploaded). */
  :: atomic { cstate == 0 -> highest(wm, true);
       if
       :: rows[best].kind == CAP_A -> exists[1] = true; cstate = 1
       :: rows[best].kind == TOMB && retired_at == 0 && nrows < MAXROWS ->
          /* nothing left to copy: A is only retired, by a version of its own */
          wm++; retired_at = wm; cstate = 2
       :: else -> skip
       fi; i = 0; best = 0 }
  /* The switch, in the publish turn: re-check, write the move row, commit or be refused. */
  :: atomic { cstate == 1 && nrows < MAXROWS -> highest(wm, true);
       if
#ifdef NO_RECHECK
       :: true ->
#else
       :: rows[best].kind == CAP_A ->
#endif
          if
          :: add_row(wm + 1, MOVE_B, true, MOVES_IN_CAPTURES); wm++; retired_at = wm; cstate = 2
          :: failures == 0 -> add_row(wm + 1, MOVE_B, false, MOVES_IN_CAPTURES); failures++
          fi
       :: else ->
          /* changed since the plan: no committed row names B, which is deleted; the job is planned again */
          exists[1] = false; cstate = 0
       fi; i = 0; best = 0 }
  /* The deleter, once: a tombstone at the next version (in the turn, so never inside a switch). */
  :: atomic { !deleted_ever && nrows < MAXROWS -> highest(wm, true);
       if
       :: rows[best].kind != TOMB -> add_row(wm + 1, TOMB, true, false); wm++; deleted_ever = true; deleted_at = wm
       :: else -> skip
       fi; i = 0; best = 0 }
  /* Erasure after the switch: X deleted, B (which a committed move names) is retired by a version of its own. */
  :: atomic { cstate == 2 && deleted_ever && b_retired_at == 0 && exists[1] -> highest(wm, true);
       if
       :: rows[best].kind == TOMB -> wm++; b_retired_at = wm
       :: else -> skip
       fi; i = 0; best = 0 }
  /* An old object is removed once its retirement is committed and no reader pinned below it is reading. */
#ifdef NO_GRACE
  :: atomic { retired_at > 0 && exists[0] -> exists[0] = false }
  :: atomic { b_retired_at > 0 && exists[1] -> exists[1] = false }
#else
  :: atomic { retired_at > 0 && exists[0] && !(rstate == 1 && rw < retired_at) -> exists[0] = false }
  :: atomic { b_retired_at > 0 && exists[1] && !(rstate == 1 && rw < b_retired_at) -> exists[1] = false }
#endif
  /* A merge of `captures`: only the highest-version row of X stays there, committed or not. */
  :: atomic { true -> best = 255; i = 0;
       do
       :: i < nrows ->
          if
          :: rows[i].incap && (best == 255 || rows[i].v >= rows[best].v) -> best = i
          :: else -> skip
          fi; i++
       :: else -> break
       od;
       i = 0;
       do
       :: i < nrows -> if :: i != best -> rows[i].incap = false :: else -> skip fi; i++
       :: else -> break
       od; i = 0; best = 0 }

  /* NO_RESURRECTION, checked after every step. */
  :: atomic { deleted_ever -> highest(wm, true); assert(rows[best].kind == TOMB || NO_RESURRECTION); i = 0; best = 0 }
  /* Row removal: X's rows below its tombstone go from every table (as if never written), once every object they
     name is retired (erasure is done with them) and no reader pinned below the tombstone is reading. */
  :: atomic { deleted_ever && !purged ->
       named_retired = true; i = 0;
       do
       :: i < nrows ->
          if
          :: rows[i].com && rows[i].v < deleted_at && rows[i].kind == CAP_A && retired_at == 0 -> named_retired = false
          :: rows[i].com && rows[i].v < deleted_at && rows[i].kind == MOVE_B && b_retired_at == 0 -> named_retired = false
          :: else -> skip
          fi; i++
       :: else -> break
       od;
       if
#ifdef PURGE_BEFORE_ERASURE
       :: !(rstate == 1 && rw < deleted_at) ->
#else
#ifdef NO_PURGE_GRACE
       :: named_retired ->
#else
       :: named_retired && !(rstate == 1 && rw < deleted_at) ->
#endif
#endif
          assert(named_retired || ERASURE_FINDABLE);
          i = 0;
          do
          :: i < nrows -> if :: rows[i].v < deleted_at -> rows[i].com = false; rows[i].incap = false :: else -> skip fi; i++
          :: else -> break
          od; purged = true
       :: else -> skip
       fi; i = 0; named_retired = false }
  od
}
